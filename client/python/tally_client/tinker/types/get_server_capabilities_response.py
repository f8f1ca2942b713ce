"""GetServerCapabilitiesResponse and SupportedModel (Tinker's
`tinker.types.get_server_capabilities_response`).

    caps = service_client.get_server_capabilities()
    [model.model_name for model in caps.supported_models]
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from tally_client._proto.tally.v1 import trainer_pb2 as pb


@dataclasses.dataclass
class SupportedModel:
    """A base_model name the server accepts."""

    model_name: Optional[str] = None
    max_context_length: Optional[int] = None


@dataclasses.dataclass
class GetServerCapabilitiesResponse:
    """get_server_capabilities' result; `server_info` is tally's full
    ServerInfo (families, dtypes, losses, mesh, limits)."""

    supported_models: List[SupportedModel]
    server_info: Optional[pb.ServerInfo] = None
