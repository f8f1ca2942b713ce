"""SampleResponse: a sample's result (Tinker's
`tinker.types.sample_response`).

    response = sampler.sample(prompt, 4, SamplingParams(max_tokens=8)).result()
    response.sequences[0].tokens, response.prompt_logprobs
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

from tally_client.tinker.types.sampled_sequence import SampledSequence


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
