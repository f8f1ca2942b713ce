"""The conversions between Tinker's types and tally's messages that the
Tinker TrainingClient sends and reads: Datums to tally Samples (with the
loss_fn_config the per-token clip thresholds fold into), and tally's results
to ForwardBackwardOutput and OptimStepResponse with Tinker's metric names
(tally's extras under "tally/").

    samples = [to_sample(datum, "ppo") for datum in data]
    config = loss_fn_config_of(data, {"clip_high_threshold": 1.2})
    output = forward_backward_output(tally_result)
"""

from __future__ import annotations

import array
from typing import Any, Dict, List, Mapping, Optional, Sequence

import grpc

from tally_client._proto.tally.v1 import trainer_pb2 as pb
from tally_client.errors import UnimplementedError
from tally_client.results import ForwardBackwardResult, OptimStepResult
from tally_client.tinker.types import (Datum, EncodedTextChunk,
                                       ForwardBackwardOutput,
                                       OptimStepResponse, TensorData)

# The prefix of tally's metrics that Tinker does not report.
EXTRA_PREFIX = "tally/"

# Tinker's record class name for per-datum outputs.
OUTPUT_TYPE = "ArrayRecord"

# Datum.loss_fn_inputs keys -> tally Sample fields. "mask" (the cookbook's
# RL datums carry one: 0 on prompt positions) is a weight.
SAMPLE_FIELDS: Dict[str, str] = {
    "target_tokens": "target_tokens", "weights": "weights", "mask": "weights",
    "advantages": "advantages", "logprobs": "sampling_logprobs"}

# Per-token loss_fn_inputs tally takes as one loss_fn_config value.
THRESHOLDS = ("clip_low_threshold", "clip_high_threshold")

# The losses whose token loss is 0 where the advantage is 0, whatever the
# weight: a position without a sampled token adds nothing to them.
_ADVANTAGE_LOSSES = ("importance_sampling", "ppo", "cispo")


def to_sample(datum: Datum, loss_fn: str) -> pb.Sample:
    """The tally Sample of a Datum (its threshold inputs aside: see
    loss_fn_config_of). A Datum of an RL loss with sampler logprobs but no
    "weights" or "mask" gets weight 0 where both its advantage and its
    sampler logprob are 0 (the prompt positions a loop pads that way), so
    that tally's policy statistics count only sampled tokens; for
    importance_sampling, ppo and cispo that changes no loss or gradient."""
    tokens = _tokens(datum)
    fields: Dict[str, List[Any]] = {}
    for key, tensor in datum.loss_fn_inputs.items():
        if key in THRESHOLDS:
            continue
        if key not in SAMPLE_FIELDS:
            raise ValueError(
                f"loss_fn_inputs key {key!r} is not supported; tally reads "
                f"{', '.join(list(SAMPLE_FIELDS) + list(THRESHOLDS))}")
        if SAMPLE_FIELDS[key] in fields:
            raise ValueError("loss_fn_inputs holds both 'weights' and 'mask'")
        values = _per_token(key, tensor, len(tokens))
        fields[SAMPLE_FIELDS[key]] = _token_ids(values) \
            if key == "target_tokens" else values
    if "target_tokens" not in fields:
        raise ValueError("loss_fn_inputs needs 'target_tokens'")
    if loss_fn in _ADVANTAGE_LOSSES and "weights" not in fields and \
            "sampling_logprobs" in fields and "advantages" in fields:
        fields["weights"] = [
            0.0 if advantage == 0 and logprob == 0 else 1.0
            for advantage, logprob in zip(fields["advantages"],
                                          fields["sampling_logprobs"])]
    return pb.Sample(input_tokens=tokens, **fields)


def loss_fn_config_of(data: Sequence[Datum], samples: Sequence[pb.Sample],
                      loss_fn_config: Optional[Dict[str, float]]
                      ) -> Optional[Dict[str, float]]:
    """`loss_fn_config` with the per-token "clip_low_threshold" and
    "clip_high_threshold" inputs of `data` (sent as `samples`) folded in:
    tally takes one value per call, so every position that counts (its
    Sample's weight, as to_sample set it, not 0) must carry
    the same value (as float32, as Tinker sends it), which must agree with
    `loss_fn_config`'s; thresholds
    that vary raise UnimplementedError before anything is sent."""
    config = dict(loss_fn_config or {})
    for key in THRESHOLDS:
        values = {value for datum, sample in zip(data, samples)
                  for value in _counted_values(datum, sample, key)}
        if not values:
            continue
        if len(values) > 1:
            raise UnimplementedError(
                "ForwardBackward", grpc.StatusCode.UNIMPLEMENTED,
                f"loss_fn_inputs[{key!r}] varies by token "
                f"({min(values)} to {max(values)}): tally takes one "
                f"{key} per call; send one value (or loss_fn_config)")
        value = values.pop()
        if key in config and array.array("f", [config[key]])[0] != value:
            raise ValueError(f"loss_fn_inputs[{key!r}] is {value} but "
                             f"loss_fn_config[{key!r}] is {config[key]}")
        config[key] = value
    return config or None


def _counted_values(datum: Datum, sample: pb.Sample,
                    key: str) -> List[float]:
    """The values of loss_fn_inputs[`key`] at the positions of `sample`
    that count (no weights: all)."""
    tensor = datum.loss_fn_inputs.get(key)
    if tensor is None:
        return []
    values = _per_token(key, tensor, len(sample.input_tokens))
    if not sample.weights:
        return values
    return [value for value, weight in zip(values, sample.weights) if weight]


def _tokens(datum: Datum) -> List[int]:
    """The token ids of a Datum's model_input; UnimplementedError for an
    image chunk (tally trains text models)."""
    for chunk in datum.model_input.chunks:
        if not isinstance(chunk, EncodedTextChunk):
            raise UnimplementedError(
                "ForwardBackward", grpc.StatusCode.UNIMPLEMENTED,
                f"model_input holds a {type(chunk).__name__}: tally trains "
                f"text models and takes EncodedTextChunks only")
    return datum.model_input.to_ints()


def _per_token(key: str, tensor: TensorData, length: int) -> List[Any]:
    """The values of `tensor`, one per position of a `length`-token input
    (shape (length,) or (length, 1))."""
    shape = tensor.shape or [len(tensor.data)]
    if len(tensor.data) != length or shape[0] != length:
        raise ValueError(
            f"loss_fn_inputs[{key!r}] has shape {shape}; a model_input of "
            f"{length} tokens needs ({length},): tally takes one value per "
            f"position")
    return tensor.data


def _token_ids(values: List[Any]) -> List[int]:
    """Token ids sent as numbers (a float32 TensorData of target_tokens):
    ints, where integral."""
    for value in values:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"loss_fn_inputs['target_tokens'] holds "
                             f"{value!r}, which is not a token id")
    return [int(value) for value in values]


def targets_only(data: Sequence[Datum]) -> List[Datum]:
    """`data` with only the target_tokens of each Datum (what forward needs
    for cross_entropy's logprobs)."""
    return [Datum(model_input=datum.model_input,
                  loss_fn_inputs={"target_tokens":
                                  datum.loss_fn_inputs["target_tokens"]})
            for datum in data]


def forward_backward_output(
        response: ForwardBackwardResult) -> ForwardBackwardOutput:
    """The ForwardBackwardOutput of a ForwardBackwardResult: Tinker's
    "loss:sum", tally's valid tokens and policy statistics as extras."""
    outputs = [{"logprobs": _vector(result.logprobs),
                "elementwise_loss": _vector(result.token_losses)}
               for result in response.samples]
    extras = {"valid_tokens:sum": float(response.valid_tokens)}
    policy = response.policy
    if policy is not None and policy.tokens:
        extras.update({
            "policy_tokens:sum": float(policy.tokens),
            "ratio:mean": policy.ratio_mean,
            "ratio:min": policy.ratio_min,
            "ratio:max": policy.ratio_max,
            "clipped_fraction:mean": policy.clipped_fraction,
            "logprob_gap:mean": policy.logprob_gap_mean,
            "logprob_gap:max": policy.logprob_gap_max,
            "kl_k1:mean": policy.kl_k1,
            "kl_k3:mean": policy.kl_k3,
        })
    return ForwardBackwardOutput(
        loss_fn_output_type=OUTPUT_TYPE, loss_fn_outputs=outputs,
        metrics={"loss:sum": response.loss_sum, **_extras(extras)})


def optim_step_response(response: OptimStepResult) -> OptimStepResponse:
    """The OptimStepResponse of a tally OptimStepResult: every metric is
    tally's, so under "tally/"."""
    metrics = dict(response.metrics)
    metrics.update(grad_norm=response.grad_norm, clip_coef=response.clip_coef,
                   learning_rate=response.learning_rate,
                   step=float(response.step), normalizer=response.normalizer,
                   skipped=float(response.skipped))
    return OptimStepResponse(metrics=_extras(metrics))


def _extras(metrics: Mapping[str, float]) -> Dict[str, float]:
    return {EXTRA_PREFIX + name: value for name, value in metrics.items()}


def _vector(values: Sequence[float]) -> TensorData:
    return TensorData(data=list(values), dtype="float32", shape=[len(values)])
