"""StopReason: why a sampled sequence ended (Tinker's
`tinker.types.stop_reason`).

    if sequence.stop_reason == "length": ...
"""

from typing import Literal

# Why a sampled sequence ended: max_tokens generated, or a stop token or
# sequence generated.
StopReason = Literal["length", "stop"]
