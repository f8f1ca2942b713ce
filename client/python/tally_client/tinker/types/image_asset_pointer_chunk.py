"""ImageAssetPointerChunk: an image inside a ModelInput, by its path or URL
(Tinker's `tinker.types.image_asset_pointer_chunk`). Sending one to tally
raises UnimplementedError, as ImageChunk.

    chunk = ImageAssetPointerChunk(format="jpeg", location="s3://b/cat.jpg",
                                   expected_tokens=256)
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from tally_client.tinker.types.image_chunk import image_length


@dataclasses.dataclass
class ImageAssetPointerChunk:
    """An image at `location` that takes `expected_tokens` positions."""

    format: Literal["png", "jpeg"]
    location: str
    expected_tokens: Optional[int] = None
    type: Literal["image_asset_pointer"] = "image_asset_pointer"

    @property
    def length(self) -> int:
        """The positions the image takes: expected_tokens, which must be
        set."""
        return image_length(self, self.expected_tokens)
