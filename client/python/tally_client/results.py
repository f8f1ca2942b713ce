"""Typed results of the clients' calls: frozen dataclasses that mirror the
tally.v1 response messages field by field.

Each class keeps its message's field names and holds them as plain Python
values: repeated fields as lists, maps as dicts, nested messages as the
class of that message, enums as the IntEnums below (they compare equal to
the pb.* values, so `info.dtype == pb.DTYPE_BFLOAT16` holds; a value this
client does not know stays a plain int). A nested message the server may
leave unset (ModelInfo.lora, ModelConfig.rope_scaling, the policy stats)
is None when absent, and so is a proto3 `optional` scalar (AdamParams,
LoraConfig). `raw` is the message itself, for anything not wrapped; it
takes no part in == or repr.

    info = ModelInfo.from_proto(pb.ModelInfo(model_id="demo", step=3))
    info.step                  # 3
    info.lora                  # None: not a LoRA adapter
    info.dtype is DType.UNSPECIFIED
    info.raw.SerializeToString()

One generic converter (TypedMessage.from_proto) builds every class from
its message, driven by the class's field annotations.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any, ClassVar, Dict, List, Optional, Type, TypeVar

__all__ = [
    "AbortResult", "AdamParams", "Artifact", "ArtifactFile", "ArtifactKind",
    "ArtifactList", "CheckpointDeleted", "ComputeInfo", "DType", "DeleteResult",
    "DevicesInfo", "ExportResult", "ForwardBackwardResult", "GpuInfo",
    "GradSync", "LimitsInfo", "LoadResult", "LogprobsResult", "LoraConfig",
    "LossReduction", "MeshInfo", "ModelConfig", "ModelInfo", "ModelList",
    "OptimStepResult", "Optimizer", "PolicyStats", "PromptLogprobs",
    "RopeScaling", "SampleResult", "SampledSequence", "SamplingResult",
    "SaveResult", "ServerInfo", "StopReason", "TopkLogprobs", "TypedMessage",
    "UnresumedModel"]


class DType(enum.IntEnum):
    """tally.v1.DType without its DTYPE_ prefix."""
    UNSPECIFIED = 0
    FLOAT32 = 1
    FLOAT64 = 2
    BFLOAT16 = 3
    FLOAT16 = 4


class Optimizer(enum.IntEnum):
    """tally.v1.Optimizer without its OPTIMIZER_ prefix."""
    UNSPECIFIED = 0
    ADAMW = 1
    SGD = 2


class LossReduction(enum.IntEnum):
    """tally.v1.LossReduction without its LOSS_REDUCTION_ prefix."""
    UNSPECIFIED = 0
    TOKEN_MEAN = 1
    SAMPLE_MEAN = 2
    SUM = 3


class GradSync(enum.IntEnum):
    """tally.v1.GradSync without its GRAD_SYNC_ prefix."""
    UNSPECIFIED = 0
    EAGER = 1
    DEFERRED = 2


class ArtifactKind(enum.IntEnum):
    """tally.v1.ArtifactKind without its ARTIFACT_KIND_ prefix."""
    UNSPECIFIED = 0
    STATE = 1             # save(): weights and optimizer state
    EXPORT = 2            # export_weights(): an HF or PEFT directory
    SAMPLER_SNAPSHOT = 3  # listed by ListSamplers, not list_checkpoints()


class StopReason(enum.IntEnum):
    """tally.v1.StopReason without its STOP_REASON_ prefix: why a sampled
    sequence ended."""
    UNSPECIFIED = 0
    LENGTH = 1  # max_tokens generated
    STOP = 2    # a stop token or sequence generated


M = TypeVar("M", bound="TypedMessage")


@dataclasses.dataclass(frozen=True)
class TypedMessage:
    """The base of every result class: `raw`, the message it was built
    from, and from_proto. PROTO: the full name of the message type."""

    PROTO: ClassVar[str] = ""
    raw: Any = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_proto(cls: Type[M], message: Any) -> M:
        """The instance of `message`, a message of type cls.PROTO; another
        message type is a TypeError."""
        name = message.DESCRIPTOR.full_name
        if name != cls.PROTO:
            raise TypeError(f"{cls.__name__} is built from {cls.PROTO}, not "
                            f"{name}")
        values = {field_name: _field_value(message, field_name, hint)
                  for field_name, hint in _field_hints(cls).items()}
        return cls(raw=message, **values)


# _field_hints' answers by class (computing one twice is harmless).
_HINTS: Dict[type, Dict[str, Any]] = {}


def _field_hints(cls: type) -> Dict[str, Any]:
    """The annotation of each message field of dataclass `cls` (every
    field but raw), resolved."""
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = {field.name: hints[field.name]
                       for field in dataclasses.fields(cls)
                       if field.name != "raw"}
    return _HINTS[cls]


def _field_value(message: Any, name: str, hint: Any) -> Any:
    """Field `name` of `message` as annotation `hint` says: Optional[X]
    None when unset, List[X] a list, Dict[str, X] a dict, X one value."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        if not message.HasField(name):
            return None
        hint = next(arg for arg in args if arg is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    value = getattr(message, name)
    if origin is list:
        if not _converts(args[0]):  # logprobs: many floats, copied at once
            return list(value)
        return [_value(args[0], item) for item in value]
    if origin is dict:
        return {key: _value(args[1], item) for key, item in value.items()}
    return _value(hint, value)


def _converts(kind: Any) -> bool:
    """Whether values of type `kind` are converted (not kept as they
    are): nested messages and enums."""
    return isinstance(kind, type) and issubclass(kind, (TypedMessage,
                                                        enum.IntEnum))


def _value(kind: Any, value: Any) -> Any:
    """One value of type `kind`: a nested message's TypedMessage, an enum's
    member (an unknown number stays an int), a scalar as protobuf gives
    it."""
    if isinstance(kind, type) and issubclass(kind, TypedMessage):
        return kind.from_proto(value)
    if isinstance(kind, type) and issubclass(kind, enum.IntEnum):
        try:
            return kind(value)
        except ValueError:
            return value
    return value


# ---- the messages of models ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RopeScaling(TypedMessage):
    """tally.v1.RopeScaling: the RoPE frequency scaling of a model."""
    PROTO: ClassVar[str] = "tally.v1.RopeScaling"
    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig(TypedMessage):
    """tally.v1.ModelConfig: a model's architecture."""
    PROTO: ClassVar[str] = "tally.v1.ModelConfig"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_local_experts: int
    num_experts_per_tok: int
    router_aux_loss_coef: float
    model_type: str
    head_dim: int
    attention_bias: bool
    mlp_bias: bool
    rope_scaling: Optional[RopeScaling]
    sliding_window: int
    max_window_layers: int
    output_router_logits: bool


@dataclasses.dataclass(frozen=True)
class AdamParams(TypedMessage):
    """tally.v1.AdamParams; None: unset."""
    PROTO: ClassVar[str] = "tally.v1.AdamParams"
    learning_rate: Optional[float]
    beta1: Optional[float]
    beta2: Optional[float]
    eps: Optional[float]
    weight_decay: Optional[float]


@dataclasses.dataclass(frozen=True)
class LoraConfig(TypedMessage):
    """tally.v1.LoraConfig: a LoRA adapter; None: unset."""
    PROTO: ClassVar[str] = "tally.v1.LoraConfig"
    rank: int
    alpha: float
    train_attn: Optional[bool]
    train_mlp: Optional[bool]
    train_unembed: Optional[bool]
    seed: Optional[int]
    init_adapter: str


@dataclasses.dataclass(frozen=True)
class ModelInfo(TypedMessage):
    """tally.v1.ModelInfo: a model, its step and its pending window
    (create_model, get_model); `lora` None: a full model."""
    PROTO: ClassVar[str] = "tally.v1.ModelInfo"
    model_id: str
    config: ModelConfig
    num_parameters: int
    step: int
    accumulated_calls: int
    accumulated_tokens: int
    accumulated_samples: int
    pending_reduction: LossReduction
    dtype: DType
    optimizer: Optimizer
    default_adam: AdamParams
    default_max_grad_norm: float
    grad_sync: GradSync
    next_seq_id: int
    activation_checkpointing: bool
    lora: Optional[LoraConfig]
    base: str
    trainable_parameters: int
    trainable_bytes: int
    damage: str
    eos_token_ids: List[int]


@dataclasses.dataclass(frozen=True)
class UnresumedModel(TypedMessage):
    """tally.v1.UnresumedModel: a model --resume could not restore."""
    PROTO: ClassVar[str] = "tally.v1.UnresumedModel"
    model_id: str
    checkpoint: str
    error: str


@dataclasses.dataclass(frozen=True)
class ModelList(TypedMessage):
    """ServerClient.list_models(): every page of ListModels in one
    tally.v1.ListModelsResponse (so no next_page_token)."""
    PROTO: ClassVar[str] = "tally.v1.ListModelsResponse"
    models: List[ModelInfo]
    unresumed: List[UnresumedModel]


@dataclasses.dataclass(frozen=True)
class DeleteResult(TypedMessage):
    """tally.v1.DeleteModelResponse: the model as it was when deleted."""
    PROTO: ClassVar[str] = "tally.v1.DeleteModelResponse"
    model: ModelInfo


# ---- the server ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ComputeInfo(TypedMessage):
    """tally.v1.ServerInfo.Compute: BLAS, oneDNN, threads, CUDA."""
    PROTO: ClassVar[str] = "tally.v1.ServerInfo.Compute"
    blas: str
    blas_library: str
    onednn: bool
    threads: int
    cuda_available: bool


@dataclasses.dataclass(frozen=True)
class MeshInfo(TypedMessage):
    """tally.v1.ServerInfo.Mesh: the ranks and their parallel dimensions."""
    PROTO: ClassVar[str] = "tally.v1.ServerInfo.Mesh"
    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    pp: int
    tp: int
    zero_stage: int


@dataclasses.dataclass(frozen=True)
class LimitsInfo(TypedMessage):
    """tally.v1.ServerInfo.Limits: message, token, memory and queue
    limits."""
    PROTO: ClassVar[str] = "tally.v1.ServerInfo.Limits"
    max_message_bytes: int
    max_tokens_per_call: int
    max_batch_tokens: int
    max_memory_bytes: int
    max_memory_bytes_per_tenant: int
    max_queued_requests: int
    max_queued_requests_per_model: int
    max_queued_requests_per_tenant: int


@dataclasses.dataclass(frozen=True)
class GpuInfo(TypedMessage):
    """tally.v1.ServerInfo.Devices.Gpu: one visible GPU."""
    PROTO: ClassVar[str] = "tally.v1.ServerInfo.Devices.Gpu"
    index: int
    name: str
    compute_capability: str
    total_memory_bytes: int


@dataclasses.dataclass(frozen=True)
class DevicesInfo(TypedMessage):
    """tally.v1.ServerInfo.Devices: the device the ranks train on."""
    PROTO: ClassVar[str] = "tally.v1.ServerInfo.Devices"
    device: str
    reason: str
    cuda_driver_version: str
    cuda_runtime_version: str
    nccl_version: str
    gpus: List[GpuInfo]
    no_gpu_reason: str
    allow_tf32: bool


@dataclasses.dataclass(frozen=True)
class ServerInfo(TypedMessage):
    """tally.v1.ServerInfo (server_info()): version, compute, mesh, model
    families, dtypes, losses, features, limits, devices."""
    PROTO: ClassVar[str] = "tally.v1.ServerInfo"
    version: str
    compute: ComputeInfo
    mesh: MeshInfo
    model_types: List[str]
    dtypes: List[DType]
    reductions: List[LossReduction]
    losses: List[str]
    features: List[str]
    limits: LimitsInfo
    authentication: bool
    devices: DevicesInfo
    base_models: List[str]  # the --models-root names CreateModel takes


# ---- training --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicyStats(TypedMessage):
    """tally.v1.PolicyStats: importance ratios, clipping and KL estimates
    of an RL loss."""
    PROTO: ClassVar[str] = "tally.v1.PolicyStats"
    tokens: int
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    clipped_fraction: float
    logprob_gap_mean: float
    logprob_gap_max: float
    kl_k1: float
    kl_k3: float


@dataclasses.dataclass(frozen=True)
class SampleResult(TypedMessage):
    """tally.v1.SampleResult: one sample's loss (logprobs and token_losses
    with return_logprobs; policy None for cross_entropy)."""
    PROTO: ClassVar[str] = "tally.v1.SampleResult"
    loss_sum: float
    valid_tokens: int
    logprobs: List[float]
    token_losses: List[float]
    policy: Optional[PolicyStats]


@dataclasses.dataclass(frozen=True)
class ForwardBackwardResult(TypedMessage):
    """tally.v1.ForwardBackwardResponse (forward_backward()): the call's
    loss, its samples, the window so far, metrics; policy None for
    cross_entropy."""
    PROTO: ClassVar[str] = "tally.v1.ForwardBackwardResponse"
    loss_sum: float
    loss_mean: float
    valid_tokens: int
    num_samples: int
    samples: List[SampleResult]
    accumulated_calls: int
    accumulated_tokens: int
    accumulated_samples: int
    metrics: Dict[str, float]
    policy: Optional[PolicyStats]


@dataclasses.dataclass(frozen=True)
class OptimStepResult(TypedMessage):
    """tally.v1.OptimStepResponse (optim_step()): the new step, gradient
    norm, clipping, learning rate, metrics."""
    PROTO: ClassVar[str] = "tally.v1.OptimStepResponse"
    step: int
    grad_norm: float
    clip_coef: float
    normalizer: float
    skipped: bool
    skip_reason: str
    learning_rate: float
    metrics: Dict[str, float]


@dataclasses.dataclass(frozen=True)
class AbortResult(TypedMessage):
    """tally.v1.AbortAccumulationResponse (abort_window()): what the
    discarded window held."""
    PROTO: ClassVar[str] = "tally.v1.AbortAccumulationResponse"
    discarded_calls: int
    discarded_tokens: int
    discarded_samples: int
    discarded_reduction: LossReduction


@dataclasses.dataclass(frozen=True)
class SaveResult(TypedMessage):
    """tally.v1.SaveCheckpointResponse (save()): where, at which step, and
    what an allow_pending save left out."""
    PROTO: ClassVar[str] = "tally.v1.SaveCheckpointResponse"
    path: str
    step: int
    bytes_written: int
    unsaved_calls: int
    unsaved_tokens: int
    unsaved_samples: int
    handle: str  # "tally://...", for download() and load() ("" without root)


@dataclasses.dataclass(frozen=True)
class LoadResult(TypedMessage):
    """tally.v1.LoadCheckpointResponse (load()): the model after the load
    and the window it discarded."""
    PROTO: ClassVar[str] = "tally.v1.LoadCheckpointResponse"
    model: ModelInfo
    discarded_calls: int
    discarded_tokens: int
    discarded_samples: int


@dataclasses.dataclass(frozen=True)
class ExportResult(TypedMessage):
    """tally.v1.ExportWeightsResponse (export_weights()): the directory
    written and its files."""
    PROTO: ClassVar[str] = "tally.v1.ExportWeightsResponse"
    path: str
    bytes_written: int
    files: List[str]
    handle: str  # as SaveResult.handle


# ---- sampling ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplerInfo(TypedMessage):
    """tally.v1.SamplerInfo (save_weights_for_sampler(), list_samplers(),
    delete_sampler()): a sampler snapshot, the weights of `step` frozen under
    `name`; `path` is its handle, tally://<model_id>/samplers/<name>."""
    PROTO: ClassVar[str] = "tally.v1.SamplerInfo"
    model_id: str
    name: str
    step: int
    bytes: int
    created_unix_micros: int
    is_adapter: bool
    path: str


@dataclasses.dataclass(frozen=True)
class SampledSequence(TypedMessage):
    """tally.v1.SampledSequence: one completion, without its prompt; each
    token's logprob is log_softmax of the raw logits (before temperature,
    top-k and top-p), what forward_backward's return_logprobs gives."""
    PROTO: ClassVar[str] = "tally.v1.SampledSequence"
    tokens: List[int]
    logprobs: List[float]
    stop_reason: StopReason


@dataclasses.dataclass(frozen=True)
class TopkLogprobs(TypedMessage):
    """tally.v1.TopkLogprobs: the k most probable tokens at one position,
    most probable first."""
    PROTO: ClassVar[str] = "tally.v1.TopkLogprobs"
    tokens: List[int]
    logprobs: List[float]


@dataclasses.dataclass(frozen=True)
class PromptLogprobs(TypedMessage):
    """tally.v1.PromptLogprobs: logprobs[i] = log p(prompt[i + 1] |
    prompt[0..i]), one per prompt token after the first; `topk` per
    position when asked for."""
    PROTO: ClassVar[str] = "tally.v1.PromptLogprobs"
    logprobs: List[float]
    topk: List[TopkLogprobs]


@dataclasses.dataclass(frozen=True)
class SamplingResult(TypedMessage):
    """tally.v1.SampleResponse (sample()): prompts x num_samples sequences,
    prompt-major (sequence p * num_samples + s is sample s of prompt p),
    each prompt's logprobs when asked for, the seed drawn with and the
    step whose weights sampled."""
    PROTO: ClassVar[str] = "tally.v1.SampleResponse"
    sequences: List[SampledSequence]
    prompt_logprobs: List[PromptLogprobs]
    seed: int
    step: int


@dataclasses.dataclass(frozen=True)
class LogprobsResult(TypedMessage):
    """tally.v1.ComputeLogprobsResponse (compute_logprobs()): one
    PromptLogprobs per prompt, in order, and the step whose weights
    computed them."""
    PROTO: ClassVar[str] = "tally.v1.ComputeLogprobsResponse"
    prompts: List[PromptLogprobs]
    step: int


# ---- artifacts -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Artifact(TypedMessage):
    """tally.v1.Artifact: a saved checkpoint or export, by its tally://
    handle (never a server path)."""
    PROTO: ClassVar[str] = "tally.v1.Artifact"
    handle: str
    kind: ArtifactKind
    model_id: str
    step: int
    size_bytes: int
    created_unix_seconds: int
    expires_unix_seconds: int  # 0: never


@dataclasses.dataclass(frozen=True)
class ArtifactList(TypedMessage):
    """tally.v1.ListCheckpointsResponse (list_checkpoints())."""
    PROTO: ClassVar[str] = "tally.v1.ListCheckpointsResponse"
    artifacts: List[Artifact]


@dataclasses.dataclass(frozen=True)
class CheckpointDeleted(TypedMessage):
    """tally.v1.DeleteCheckpointResponse (delete_checkpoint())."""
    PROTO: ClassVar[str] = "tally.v1.DeleteCheckpointResponse"
    deleted: Artifact


@dataclasses.dataclass(frozen=True)
class ArtifactFile(TypedMessage):
    """tally.v1.ArtifactFile: one file of a download's manifest."""
    PROTO: ClassVar[str] = "tally.v1.ArtifactFile"
    path: str
    size_bytes: int
    sha256: str
