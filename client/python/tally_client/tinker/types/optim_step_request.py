"""AdamParams: one optim_step's AdamW hyperparameters (Tinker's
`tinker.types.optim_step_request`).

    training_client.optim_step(AdamParams(learning_rate=4e-5, eps=1e-8))
"""

from __future__ import annotations

import dataclasses


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
