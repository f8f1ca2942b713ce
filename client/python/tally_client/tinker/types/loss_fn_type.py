"""LossFnType: the per-token objectives forward_backward takes (Tinker's
`tinker.types.loss_fn_type`).

    loss: LossFnType = "importance_sampling"
"""

from typing import Literal

LossFnType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo",
                     "dro"]
