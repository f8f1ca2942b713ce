"""ForwardBackwardOutput: a forward or forward_backward result (Tinker's
`tinker.types.forward_backward_output`).

    out = training_client.forward_backward(data, "cross_entropy").result()
    out.metrics["loss:sum"], out.loss_fn_outputs[0]["logprobs"].tolist()
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

from tally_client.tinker.types.tensor_data import TensorData

LossFnOutput = Dict[str, TensorData]


@dataclasses.dataclass
class ForwardBackwardOutput:
    """Per datum, {"logprobs": the trainer's log-probability of each target,
    "elementwise_loss": each token's weighted loss} as TensorData;
    `loss_fn_output_type` the record class name ("ArrayRecord", as
    Tinker's); `metrics` by Tinker's names ("loss:sum"), tally's extras
    under "tally/" ("tally/valid_tokens:sum", and with sampler logprobs the
    policy statistics "tally/ratio:mean", "tally/kl_k3:mean", ...)."""

    loss_fn_output_type: str
    loss_fn_outputs: List[LossFnOutput]
    metrics: Dict[str, float] = dataclasses.field(default_factory=dict)
