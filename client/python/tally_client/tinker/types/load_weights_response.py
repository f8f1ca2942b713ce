"""LoadWeightsResponse: load_state's result (Tinker's
`tinker.types.load_weights_response`).

    training_client.load_state(path).result().path
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class LoadWeightsResponse:
    """load_state's result: the checkpoint loaded and the model it was
    loaded onto."""

    path: Optional[str] = None
    model_id: Optional[str] = None
