"""Turns what a training loop has (lists, numpy arrays, torch tensors) into
tally.v1 Samples.

    sample([1, 2, 3], [2, 3, -100])
    sample(prompt + completion[:-1], prompt[1:] + completion,
           advantages=advantages, sampling_logprobs=sampler_logprobs)
    to_samples([(np.array([1, 2]), np.array([2, 5]))])
    samples_from_batch(tokens, targets)  # 2-D; -100 targets are ignored
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from tally_client._proto.tally.v1 import trainer_pb2 as pb

IGNORE_INDEX = -100

# Per-token values: a list or tuple, a 1-D numpy array or torch tensor.
Values = Any
# What to_samples takes for one sample: a pb.Sample, a tuple of sample()'s
# positional arguments, or a dict of its keyword arguments.
SampleLike = Union[pb.Sample, Tuple[Values, ...], Dict[str, Values]]


def to_list(values: Values) -> List[Any]:
    """A flat Python list from a list, tuple, numpy array or torch tensor."""
    if hasattr(values, "detach"):  # torch.Tensor
        values = values.detach().cpu()
    if hasattr(values, "tolist"):
        values = values.tolist()
    return list(values)


def sample(input_tokens: Values, target_tokens: Values,
           weights: Optional[Values] = None,
           advantages: Optional[Values] = None,
           sampling_logprobs: Optional[Values] = None) -> pb.Sample:
    """A Sample; target_tokens[i] follows input_tokens[:i + 1], -100 ignores
    a position. The optional per-token values, one per token: weights scale
    each position's loss (any sign; 0 ignores it), advantages and
    sampling_logprobs (the sampler's log-probability of each target) are the
    inputs of the RL losses (TrainingClient.forward_backward's loss_fn)."""
    inputs, targets = to_list(input_tokens), to_list(target_tokens)
    if len(inputs) != len(targets):
        raise ValueError(f"input_tokens has {len(inputs)} tokens but "
                         f"target_tokens has {len(targets)}")
    result = pb.Sample(input_tokens=inputs, target_tokens=targets)
    per_token = {"weights": weights, "advantages": advantages,
                 "sampling_logprobs": sampling_logprobs}
    for name, values in per_token.items():
        if values is None:
            continue
        values = to_list(values)
        if len(values) != len(inputs):
            raise ValueError(f"{name} has {len(values)} values for "
                             f"{len(inputs)} tokens")
        getattr(result, name).extend(values)
    return result


def to_samples(samples: Iterable[SampleLike]) -> List[pb.Sample]:
    """Samples from pb.Sample objects, (inputs, targets[, weights[,
    advantages[, sampling_logprobs]]]) tuples, or dicts of sample()'s
    arguments ({"input_tokens", "target_tokens"[, "weights", "advantages",
    "sampling_logprobs"]})."""
    out: List[pb.Sample] = []
    for item in samples:
        if isinstance(item, pb.Sample):
            out.append(item)
        elif isinstance(item, dict):
            out.append(sample(**item))
        else:
            out.append(sample(*item))
    return out


def samples_from_batch(input_tokens: Sequence[Values],
                       target_tokens: Sequence[Values],
                       weights: Optional[Sequence[Values]] = None,
                       pad_target: int = IGNORE_INDEX) -> List[pb.Sample]:
    """One Sample per row of 2-D inputs/targets (lists, numpy, torch); each
    row is cut after its last target that is not `pad_target`, so padding
    costs nothing on the server."""
    rows = []
    weight_rows = [None] * len(input_tokens) if weights is None else weights
    for inputs, targets, row_weights in zip(input_tokens, target_tokens,
                                            weight_rows):
        targets = to_list(targets)
        length = len(targets)
        while length > 0 and targets[length - 1] == pad_target:
            length -= 1
        length = max(length, 1)
        rows.append(sample(to_list(inputs)[:length], targets[:length],
                           None if row_weights is None
                           else to_list(row_weights)[:length]))
    return rows
