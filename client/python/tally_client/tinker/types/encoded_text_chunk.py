"""EncodedTextChunk: a run of token ids inside a ModelInput (Tinker's
`tinker.types.encoded_text_chunk`).

    chunk = EncodedTextChunk(tokens=[1, 2, 3])   # chunk.length == 3
"""

from __future__ import annotations

import dataclasses
from typing import List, Literal


@dataclasses.dataclass
class EncodedTextChunk:
    """A run of token ids inside a ModelInput."""

    tokens: List[int]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        """How many positions the chunk takes in the context."""
        return len(self.tokens)
