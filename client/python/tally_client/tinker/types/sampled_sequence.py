"""SampledSequence: one completion of a sample (Tinker's
`tinker.types.sampled_sequence`).

    for sequence in response.sequences: sequence.tokens, sequence.logprobs
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from tally_client.tinker.types.stop_reason import StopReason


@dataclasses.dataclass(frozen=True)
class SampledSequence:
    """One completion: its tokens (without the prompt), each token's
    log-probability under the model before temperature, top-k and top-p
    (what forward_backward's logprobs give for the same sequence, and what
    the RL losses take as the sampler's "logprobs"), and why it ended."""

    stop_reason: StopReason
    tokens: List[int]
    logprobs: Optional[List[float]] = None
