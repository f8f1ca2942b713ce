"""Datum: one training example, a ModelInput and the per-token inputs of
the loss (Tinker's `tinker.types.datum`).

    datum = Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                  loss_fn_inputs={"target_tokens": tokens[1:],
                                  "weights": weights[1:]})
    datum.loss_fn_inputs["weights"].to_numpy()
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Dict

from tally_client.tinker.types.model_input import ModelInput
from tally_client.tinker.types.tensor_data import TensorData
from tally_client.tinker.types.tensor_dtype import TensorDtype

# The dtype a list value of loss_fn_inputs is stored as, by key (Tinker's);
# other keys: int64 when every value is an int, else float32.
_INPUT_DTYPES: Dict[str, TensorDtype] = {
    "target_tokens": "int64", "weights": "float32", "mask": "float32",
    "advantages": "float32", "logprobs": "float32",
    "clip_low_threshold": "float32", "clip_high_threshold": "float32"}

LossFnInputs = Dict[str, TensorData]


def to_tensor_data(key: str, value: Any) -> TensorData:
    """`value` of loss_fn_inputs[`key`] as TensorData: a TensorData, a
    ModelInput (its tokens), a numpy array, a torch tensor, or a (nested)
    list stored in the key's dtype (int64 for "target_tokens", which takes
    integral floats, float32 for "weights", "advantages", "logprobs" and the
    clip thresholds)."""
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
        dtype: TensorDtype = _INPUT_DTYPES.get(key) or (
            "int64" if all(isinstance(v, int) for v in value) else "float32")
        try:
            tensor = TensorData(data=list(value), dtype=dtype)
        except ValueError as error:
            raise ValueError(f"loss_fn_inputs[{key!r}]: {error}") from error
        # As Tinker's (a list becomes an array): the shape is always set.
        tensor.shape = tensor.shape or [len(tensor.data)]
        return tensor
    raise TypeError(f"loss_fn_inputs[{key!r}]: expected TensorData, a numpy "
                    f"array, a torch tensor or a list, not "
                    f"{type(value).__name__}")


@dataclasses.dataclass(frozen=True)
class Datum:
    """One training example: the model's input and the per-token inputs of
    the loss by Tinker's names ("target_tokens", "weights", "advantages",
    "logprobs": the sampler's log-probabilities, "clip_low_threshold",
    "clip_high_threshold"), each as long as model_input. Values are
    converted to TensorData."""

    model_input: ModelInput
    loss_fn_inputs: LossFnInputs = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss_fn_inputs", {
            key: to_tensor_data(key, value)
            for key, value in self.loss_fn_inputs.items()})
