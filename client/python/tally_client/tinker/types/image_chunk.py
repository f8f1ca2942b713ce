"""ImageChunk: an image inside a ModelInput, by its bytes (Tinker's
`tinker.types.image_chunk`). tally trains text models only: a ModelInput
holding one can be built, but sending it raises UnimplementedError.

    chunk = ImageChunk(data=png_bytes, format="png", expected_tokens=256)
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Literal, Optional, Union


@dataclasses.dataclass
class ImageChunk:
    """An image (png or jpeg bytes; a base64 string is decoded) that takes
    `expected_tokens` positions of the context."""

    data: Union[bytes, str]
    format: Literal["png", "jpeg"]
    expected_tokens: Optional[int] = None
    type: Literal["image"] = "image"

    def __post_init__(self) -> None:
        if isinstance(self.data, str):
            self.data = base64.b64decode(self.data)

    @property
    def length(self) -> int:
        """The positions the image takes: expected_tokens, which must be
        set."""
        return image_length(self, self.expected_tokens)


def image_length(chunk: object, expected_tokens: Optional[int]) -> int:
    """An image chunk's length: `expected_tokens`, or ValueError when it is
    None (shared by the image chunk types)."""
    if expected_tokens is None:
        raise ValueError(f"{type(chunk).__name__}.expected_tokens needs to "
                         f"be set to compute its length")
    return expected_tokens
