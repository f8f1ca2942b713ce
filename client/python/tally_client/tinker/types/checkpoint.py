"""Checkpoint, CheckpointType and CheckpointsListResponse: what
RestClient.list_checkpoints returns (Tinker's `tinker.types.checkpoint` and
`checkpoints_list_response`), made from tally's artifacts.

    listed = rest_client.list_checkpoints(model_id).result()
    states = [c.tinker_path for c in listed.checkpoints
              if c.checkpoint_type == "training"]
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import List, Literal, Optional

# "training": a save_state checkpoint; "sampler": a save_weights_for_sampler
# directory.
CheckpointType = Literal["training", "sampler"]


@dataclasses.dataclass
class Checkpoint:
    """One saved checkpoint. `tinker_path`: its tally:// handle, which
    load_state, create_training_client_from_state and the RestClient take;
    `checkpoint_id`: the handle under its model ("weights/<name>")."""

    checkpoint_id: str
    checkpoint_type: CheckpointType
    time: datetime.datetime
    tinker_path: str
    size_bytes: Optional[int] = None
    public: bool = False
    expires_at: Optional[datetime.datetime] = None


@dataclasses.dataclass
class CheckpointsListResponse:
    """list_checkpoints' result. `cursor`: always None (tally lists every
    checkpoint at once)."""

    checkpoints: List[Checkpoint]
    cursor: Optional[object] = None
