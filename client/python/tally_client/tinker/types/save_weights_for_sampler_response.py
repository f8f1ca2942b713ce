"""SaveWeightsForSamplerResponse: save_weights_for_sampler's result
(Tinker's `tinker.types.save_weights_for_sampler_response`).

    path = training_client.save_weights_for_sampler("s1").result().path
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SaveWeightsForSamplerResponse:
    """save_weights_for_sampler's result: the sampler snapshot's handle
    (tally://<model_id>/samplers/<name>), or with export the server-side
    directory written."""

    path: str
