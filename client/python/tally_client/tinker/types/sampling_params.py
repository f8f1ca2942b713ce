"""SamplingParams: how SamplingClient.sample draws (Tinker's
`tinker.types.sampling_params`).

    params = SamplingParams(max_tokens=32, temperature=0.7, stop=[eos_id])
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union


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
