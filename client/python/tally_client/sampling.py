"""The requests of TrainingClient.sample and compute_logprobs: prompts and
stop conditions as the client takes them, converted to tally.v1 messages.

    request = sample_request("demo", [[1, 2, 3]], num_samples=4,
                             max_tokens=8, temperature=0.0, stop=[2, [5, 6]])
    request.prompts[0].tokens        # [1, 2, 3]
    request.params.stop.token_ids    # [2]
    request.params.stop.sequences    # [TokenSequence(tokens=[5, 6])]

A prompt is a sequence of token ids (a list, tuple, numpy array or torch
tensor). `stop` is None (the model's EOS ids, ModelInfo.eos_token_ids), a
pb.StopConditions, or a sequence whose ints are stop tokens and whose
token sequences are stop sequences (empty: only max_tokens ends a sequence).
Anything else is a ValueError naming the argument, raised before anything is
sent.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Union

from tally_client._proto.tally.v1 import trainer_pb2 as pb

# A prompt's token ids: a list, tuple, numpy array or torch tensor of ints.
TokensLike = Sequence[int]
# What ends a sequence: stop tokens (ints) and stop token sequences.
StopLike = Union[None, pb.StopConditions, Sequence[Union[int, TokensLike]]]


def sample_request(model_id: str, prompts: Sequence[TokensLike], *,
                   num_samples: int, max_tokens: int,
                   temperature: Optional[float], top_p: Optional[float],
                   top_k: Optional[int], stop: StopLike, seed: Optional[int],
                   include_prompt_logprobs: bool,
                   topk_prompt_logprobs: int,
                   sampler: Optional[str] = None) -> pb.SampleRequest:
    """The SampleRequest of TrainingClient.sample's arguments (None leaves
    an optional parameter unset: the server's default; `sampler` None: the
    live weights)."""
    params = pb.SamplingParams(max_tokens=int(max_tokens))
    for name, value in (("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("seed", seed)):
        if value is not None:
            setattr(params, name, value)
    conditions = stop_conditions(stop)
    if conditions is not None:
        params.stop.CopyFrom(conditions)
    return pb.SampleRequest(
        model_id=model_id, prompts=token_sequences(prompts, "prompts"),
        num_samples=int(num_samples), params=params,
        include_prompt_logprobs=bool(include_prompt_logprobs),
        topk_prompt_logprobs=int(topk_prompt_logprobs),
        sampler=sampler_name(sampler))


def logprobs_request(model_id: str, prompts: Sequence[TokensLike],
                     topk: int,
                     sampler: Optional[str] = None
                     ) -> pb.ComputeLogprobsRequest:
    """The ComputeLogprobsRequest of TrainingClient.compute_logprobs'
    arguments."""
    return pb.ComputeLogprobsRequest(
        model_id=model_id, prompts=token_sequences(prompts, "prompts"),
        topk=int(topk), sampler=sampler_name(sampler))


def sampler_name(sampler: Optional[str]) -> str:
    """The request's `sampler` field: "" (the live weights) for None, else
    the snapshot name (a str; anything else is a ValueError)."""
    if sampler is None:
        return ""
    if not isinstance(sampler, str):
        raise ValueError(f"sampler must be a snapshot name (str), not "
                         f"{type(sampler).__name__}")
    return sampler


def token_sequences(prompts: Sequence[TokensLike],
                    what: str) -> List[pb.TokenSequence]:
    """One TokenSequence per prompt of `prompts`; a flat sequence of ints
    (one prompt not wrapped in a list) is a ValueError naming `what`."""
    if isinstance(prompts, (str, bytes)) or not _is_sequence(prompts):
        raise ValueError(f"{what} must be a list of prompts (each a list of "
                         f"token ids), not {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and _is_token(prompts[0]):
        raise ValueError(f"{what} must be a list of prompts, each a list of "
                         f"token ids: wrap a single prompt, [prompt]")
    return [pb.TokenSequence(tokens=_tokens(prompt, f"{what}[{i}]"))
            for i, prompt in enumerate(prompts)]


def stop_conditions(stop: StopLike) -> Optional[pb.StopConditions]:
    """The StopConditions of `stop` (see the module's docstring); None for
    None (the model's EOS ids)."""
    if stop is None or isinstance(stop, pb.StopConditions):
        return stop
    if isinstance(stop, (str, bytes)) or not _is_sequence(stop):
        raise ValueError(
            f"stop must be token ids and token-id sequences, not "
            f"{type(stop).__name__} (a string stop needs a tokenizer: "
            f"tally_client.tinker.SamplingClient(tokenizer=...))")
    conditions = pb.StopConditions()
    for i, item in enumerate(stop):
        if _is_token(item):
            conditions.token_ids.append(int(item))
        else:
            conditions.sequences.add(tokens=_tokens(item, f"stop[{i}]"))
    return conditions


def _tokens(values: Any, what: str) -> List[int]:
    """`values` as a list of token ids; a ValueError naming `what`
    otherwise."""
    if hasattr(values, "tolist"):  # numpy arrays and torch tensors
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not _is_sequence(values) or \
            not all(_is_token(value) for value in values):
        raise ValueError(f"{what} must be a sequence of token ids (ints), "
                         f"not {values!r:.80}")
    return [int(value) for value in values]


def _is_token(value: Any) -> bool:
    """Whether `value` is one token id: an int (numpy's and 0-d torch
    tensors' too), not a bool."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return hasattr(value, "__index__") and getattr(value, "ndim", 0) == 0


def _is_sequence(value: Any) -> bool:
    return hasattr(value, "__len__") and hasattr(value, "__getitem__")
