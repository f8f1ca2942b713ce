"""ModelInput: a model's input sequence as chunks (Tinker's
`tinker.types.model_input`).

    prompt = ModelInput.from_ints([1, 2, 3]).append_int(4)
    prompt.to_ints(), prompt.length          # [1, 2, 3, 4], 4
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence

from tally_client.tinker.types.encoded_text_chunk import EncodedTextChunk
from tally_client.tinker.types.model_input_chunk import ModelInputChunk


@dataclasses.dataclass
class ModelInput:
    """A model's input sequence as chunks: token chunks, and the image
    chunk types (which tally refuses when sent)."""

    chunks: List[ModelInputChunk]

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> "ModelInput":
        """A ModelInput of one chunk holding `tokens`."""
        return cls(chunks=[EncodedTextChunk(tokens=[int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> "ModelInput":
        """A ModelInput without chunks."""
        return cls(chunks=[])

    def to_ints(self) -> List[int]:
        """Every token of every chunk, in order; ValueError if a chunk is
        not a token chunk."""
        tokens: List[int] = []
        for chunk in self.chunks:
            if not isinstance(chunk, EncodedTextChunk):
                raise ValueError(f"to_ints needs EncodedTextChunks only, the "
                                 f"ModelInput holds a "
                                 f"{type(chunk).__name__}")
            tokens.extend(chunk.tokens)
        return tokens

    @property
    def length(self) -> int:
        """The context length the input takes."""
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: ModelInputChunk) -> "ModelInput":
        """A new ModelInput with `chunk` after this one's chunks."""
        return ModelInput(chunks=self.chunks + [chunk])

    def append_int(self, token: int) -> "ModelInput":
        """A new ModelInput with one more token."""
        return self.append(EncodedTextChunk(tokens=[int(token)]))
