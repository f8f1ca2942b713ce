"""SaveWeightsResponse: save_state's result (Tinker's
`tinker.types.save_weights_response`).

    path = training_client.save_state("s1").result().path
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SaveWeightsResponse:
    """save_state's result: the checkpoint's path, which load_state and
    create_training_client_from_state take."""

    path: str
