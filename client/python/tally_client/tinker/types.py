"""The data types of Tinker's Python SDK (`tinker.types`), as tally's Tinker
client takes and returns them.

Same names, fields, defaults and helpers as Tinker's, as plain dataclasses:
a training loop builds Datums from ModelInputs and per-token TensorData
(lists, numpy arrays or torch tensors), and reads ForwardBackwardOutput's
per-datum "logprobs" and "elementwise_loss". numpy and torch are imported
only by the conversions that return them (TensorData.to_numpy / to_torch).

    datum = Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                  loss_fn_inputs={"target_tokens": tokens[1:],
                                  "weights": weights[1:]})
    datum.loss_fn_inputs["weights"].to_numpy()
"""

from __future__ import annotations

import array
import dataclasses
import math
import sys
from typing import (Any, Dict, List, Literal, Optional, Sequence, Tuple,
                    Union)

from tally_client._proto.tally.v1 import trainer_pb2 as pb

# The per-token objectives forward_backward accepts (Tinker's names).
LossFnType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo",
                     "dro"]

# The dtype a plain list of loss_fn_inputs values is stored as, by key
# (Tinker's wire dtypes); other keys: int64 when every value is an int.
_INPUT_DTYPES = {"target_tokens": "int64", "weights": "float32",
                 "advantages": "float32", "logprobs": "float32"}

# array.array typecodes that store (and round) a TensorData dtype.
_TYPECODES = {"int64": "q", "float32": "f"}


@dataclasses.dataclass
class EncodedTextChunk:
    """A run of token ids inside a ModelInput."""

    tokens: List[int]

    @property
    def length(self) -> int:
        """How many positions the chunk takes in the context."""
        return len(self.tokens)


@dataclasses.dataclass
class ModelInput:
    """A model's input sequence as chunks. tally takes token chunks only
    (Tinker's image chunks have no tally counterpart)."""

    chunks: List[EncodedTextChunk]

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> "ModelInput":
        """A ModelInput of one chunk holding `tokens`."""
        return cls(chunks=[EncodedTextChunk(tokens=[int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> "ModelInput":
        return cls(chunks=[])

    def to_ints(self) -> List[int]:
        """Every token of every chunk, in order."""
        return [token for chunk in self.chunks for token in chunk.tokens]

    @property
    def length(self) -> int:
        """The context length the input takes."""
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> "ModelInput":
        """A new ModelInput with `chunk` after this one's chunks."""
        return ModelInput(chunks=self.chunks + [chunk])

    def append_int(self, token: int) -> "ModelInput":
        """A new ModelInput with one more token."""
        return self.append(EncodedTextChunk(tokens=[int(token)]))


@dataclasses.dataclass
class TensorData:
    """A flat, typed tensor: `data` in row-major order, `dtype` "int64" or
    "float32" (values are stored rounded to it), `shape` (None: 1-D)."""

    data: List[Any]
    dtype: str
    shape: Optional[List[int]] = None

    def __post_init__(self) -> None:
        if self.dtype not in _TYPECODES:
            raise ValueError(f"TensorData dtype must be one of "
                             f"{sorted(_TYPECODES)}, not {self.dtype!r}")
        try:
            self.data = array.array(_TYPECODES[self.dtype], self.data).tolist()
        except (TypeError, OverflowError) as error:
            raise ValueError(f"TensorData of dtype {self.dtype}: {error}") \
                from error
        if self.shape is not None:
            self.shape = [int(size) for size in self.shape]
            if math.prod(self.shape) != len(self.data):
                raise ValueError(f"TensorData has {len(self.data)} values for "
                                 f"shape {self.shape}")

    @classmethod
    def from_numpy(cls, array_like: Any) -> "TensorData":
        """From a numpy array: float kinds become float32, integer kinds
        int64."""
        return cls(data=array_like.flatten().tolist(),
                   dtype=_dtype_of_kind(array_like.dtype.kind,
                                        array_like.dtype),
                   shape=list(array_like.shape))

    @classmethod
    def from_torch(cls, tensor: Any) -> "TensorData":
        """From a torch tensor: floating dtypes become float32, the others
        int64."""
        return cls(data=tensor.detach().cpu().flatten().tolist(),
                   dtype="float32" if tensor.dtype.is_floating_point
                   else "int64",
                   shape=list(tensor.shape))

    def to_numpy(self) -> Any:
        """A numpy array of this dtype and shape."""
        import numpy  # pylint: disable=import-outside-toplevel
        values = numpy.array(self.data, dtype=self.dtype)
        return values if self.shape is None else values.reshape(self.shape)

    def to_torch(self) -> Any:
        """A torch tensor of this dtype and shape."""
        import torch  # pylint: disable=import-outside-toplevel
        values = torch.tensor(self.data, dtype=getattr(torch, self.dtype))
        return values if self.shape is None else values.reshape(self.shape)

    def tolist(self) -> List[Any]:
        """The values as (nested, by shape) Python lists."""
        return _nest(self.data, self.shape or [len(self.data)])


def _dtype_of_kind(kind: str, dtype: Any) -> str:
    if kind == "f":
        return "float32"
    if kind in "iu":
        return "int64"
    raise ValueError(f"TensorData holds floats or integers, not {dtype}")


def _nest(values: List[Any], shape: List[int]) -> List[Any]:
    if len(shape) <= 1:
        return list(values)
    step = len(values) // shape[0] if shape[0] else 0
    return [_nest(values[i * step:(i + 1) * step], shape[1:])
            for i in range(shape[0])]


def to_tensor_data(key: str, value: Any) -> TensorData:
    """`value` of loss_fn_inputs[`key`] as TensorData: a TensorData, a
    ModelInput (its tokens), a numpy array, a torch tensor, or a flat list
    (stored in the key's dtype: int64 for "target_tokens", float32 for
    "weights", "advantages" and "logprobs")."""
    if isinstance(value, TensorData):
        return value
    if isinstance(value, ModelInput):
        tokens = value.to_ints()
        return TensorData(data=tokens, dtype="int64", shape=[len(tokens)])
    # A value can only be a numpy array or a torch tensor if the loop
    # imported that library.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return TensorData.from_torch(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return TensorData.from_numpy(value)
    if isinstance(value, (list, tuple)):
        dtype = _INPUT_DTYPES.get(key) or (
            "int64" if all(isinstance(v, int) for v in value) else "float32")
        return TensorData(data=list(value), dtype=dtype, shape=[len(value)])
    raise TypeError(f"loss_fn_inputs[{key!r}]: expected TensorData, a numpy "
                    f"array, a torch tensor or a list, not "
                    f"{type(value).__name__}")


@dataclasses.dataclass(frozen=True)
class Datum:
    """One training example: the model's input and the per-token inputs of
    the loss, by Tinker's names ("target_tokens", "weights", "advantages",
    "logprobs": the sampler's log-probabilities), each as long as
    model_input. Values are converted to TensorData."""

    model_input: ModelInput
    loss_fn_inputs: Dict[str, TensorData] = dataclasses.field(
        default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss_fn_inputs", {
            key: to_tensor_data(key, value)
            for key, value in self.loss_fn_inputs.items()})


@dataclasses.dataclass
class AdamParams:
    """One optim_step's AdamW hyperparameters, with Tinker's defaults
    (torch.optim.AdamW semantics, decoupled weight decay). grad_clip_norm:
    the global gradient norm to clip to; 0 means no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclasses.dataclass
class ForwardBackwardOutput:
    """A forward or forward_backward result: per datum, {"logprobs": the
    trainer's log-probability of each target, "elementwise_loss": each
    token's weighted loss} as TensorData; `metrics` as "name:reduction"
    ("loss:sum", and with sampler logprobs the policy statistics)."""

    loss_fn_output_type: str
    loss_fn_outputs: List[Dict[str, TensorData]]
    metrics: Dict[str, float]


@dataclasses.dataclass
class OptimStepResponse:
    """An optim_step result; tally's metrics include grad_norm, clip_coef,
    learning_rate and step."""

    metrics: Optional[Dict[str, float]] = None


@dataclasses.dataclass
class SaveWeightsResponse:
    """save_state's result: the server-side checkpoint directory."""

    path: str


@dataclasses.dataclass
class SaveWeightsForSamplerResponse:
    """save_weights_for_sampler's result: the sampler snapshot's handle
    (tally://<model_id>/samplers/<name>), or with export the server-side
    directory written."""

    path: str


@dataclasses.dataclass
class LoadWeightsResponse:
    """load_state's result: the checkpoint directory loaded."""

    path: Optional[str] = None


@dataclasses.dataclass
class ModelData:
    """A training model's architecture (config.json model_type) and the
    base model it was created from."""

    arch: Optional[str] = None
    model_name: Optional[str] = None


@dataclasses.dataclass
class GetInfoResponse:
    """get_info's result; `model_info` is tally's full ModelInfo (step,
    config, pending window, ...)."""

    model_data: ModelData
    model_id: str
    is_lora: bool = False
    lora_rank: Optional[int] = None
    model_name: Optional[str] = None
    model_info: Optional[pb.ModelInfo] = None


@dataclasses.dataclass
class SupportedModel:
    """A base_model name the server accepts."""

    model_name: str


@dataclasses.dataclass
class GetServerCapabilitiesResponse:
    """get_server_capabilities' result; `server_info` is tally's full
    ServerInfo (families, dtypes, losses, mesh, limits)."""

    supported_models: List[SupportedModel]
    server_info: Optional[pb.ServerInfo] = None


# ---- sampling ---------------------------------------------------------------

# Why a sampled sequence ended: max_tokens generated, or a stop token or
# sequence generated.
StopReason = Literal["length", "stop"]


@dataclasses.dataclass
class SamplingParams:
    """How SamplingClient.sample draws, with Tinker's fields and defaults.
    `max_tokens`: the most tokens per sequence (tally needs one, >= 1).
    `seed`: None lets the server pick. `stop`: None: the model's EOS ids;
    token ids (ints) or strings (each encoded by the SamplingClient's
    tokenizer, which a string needs) end a sequence; an empty list: only
    max_tokens does. `temperature` 0: greedy; `top_k` -1: off; `top_p` 1:
    off."""

    max_tokens: Optional[int] = None
    seed: Optional[int] = None
    stop: Union[str, Sequence[str], Sequence[int], None] = None
    temperature: float = 1
    top_k: int = -1
    top_p: float = 1


@dataclasses.dataclass(frozen=True)
class SampledSequence:
    """One completion: its tokens (without the prompt), each token's
    log-probability under the model before temperature, top-k and top-p
    (what forward_backward's logprobs give for the same sequence, and what
    the RL losses take as the sampler's "logprobs"), and why it ended."""

    stop_reason: StopReason
    tokens: List[int]
    logprobs: Optional[List[float]] = None


@dataclasses.dataclass(frozen=True)
class SampleResponse:
    """A sample's result: `sequences` (num_samples of them); with
    include_prompt_logprobs, `prompt_logprobs` (one per prompt token, None
    for the first, which has no context); with topk_prompt_logprobs k > 0,
    `topk_prompt_logprobs` ((token, logprob) pairs per position, most
    probable first, None for the first). tally's extras: the `seed` the
    sequences were drawn with and the model `step` whose weights sampled."""

    sequences: Sequence[SampledSequence]
    prompt_logprobs: Optional[List[Optional[float]]] = None
    topk_prompt_logprobs: Optional[
        List[Optional[List[Tuple[int, float]]]]] = None
    seed: Optional[int] = None
    step: Optional[int] = None
