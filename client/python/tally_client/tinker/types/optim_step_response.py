"""OptimStepResponse: an optim_step result (Tinker's
`tinker.types.optim_step_response`).

    metrics = training_client.optim_step(AdamParams()).result().metrics
    metrics["tally/grad_norm"]
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional


@dataclasses.dataclass
class OptimStepResponse:
    """An optim_step result. tally's metrics are its extras, each under
    "tally/" so that a loop merging them into its own (step, learning_rate)
    overwrites nothing: tally/grad_norm (before clipping), tally/clip_coef,
    tally/learning_rate, tally/step, tally/normalizer, tally/skipped and the
    server's per-step measurements."""

    metrics: Optional[Dict[str, float]] = None
