"""GetInfoResponse and ModelData: TrainingClient.get_info's result
(Tinker's `tinker.types.get_info_response`).

    info = training_client.get_info()
    info.model_data.tokenizer_id, info.lora_rank, info.model_info.step
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tally_client._proto.tally.v1 import trainer_pb2 as pb


@dataclasses.dataclass
class ModelData:
    """A training model's architecture (config.json model_type), the base
    model it was created from, and where its tokenizer's files are (the
    base's directory; None for a base without one, as tally/demo)."""

    arch: Optional[str] = None
    model_name: Optional[str] = None
    tokenizer_id: Optional[str] = None


@dataclasses.dataclass
class GetInfoResponse:
    """get_info's result; `model_info` is tally's full ModelInfo (step,
    config, pending window, ...)."""

    model_data: ModelData
    model_id: str
    is_lora: Optional[bool] = None
    lora_rank: Optional[int] = None
    model_name: Optional[str] = None
    model_info: Optional[pb.ModelInfo] = None
