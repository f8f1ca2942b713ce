"""ModelInputChunk: the chunk types a ModelInput holds (Tinker's
`tinker.types.model_input_chunk`); tally sends EncodedTextChunks only.

    def tokens_of(chunk: ModelInputChunk) -> int: return chunk.length
"""

from typing import Union

from tally_client.tinker.types.encoded_text_chunk import EncodedTextChunk
from tally_client.tinker.types.image_asset_pointer_chunk import \
    ImageAssetPointerChunk
from tally_client.tinker.types.image_chunk import ImageChunk

ModelInputChunk = Union[EncodedTextChunk, ImageAssetPointerChunk, ImageChunk]
