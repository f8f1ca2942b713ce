"""The tokenizer of a tally model, for Tinker's get_tokenizer(): loaded from
the tokenizer files in its base model's directory (GetInfoResponse
.model_data.tokenizer_id) with transformers, or with tokenizers when
transformers is not installed.

    tokenizer = load_tokenizer("/data/Qwen3-0.6B")
    tokenizer.encode("Hello", add_special_tokens=False)

The directory must be readable where the client runs (tally serves no
tokenizer files); otherwise, and without either library, the error says
what to do.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, List, Optional


def load_tokenizer(tokenizer_id: Optional[str]) -> Any:
    """The tokenizer whose files are in directory `tokenizer_id`: a
    transformers AutoTokenizer when transformers is importable, else a
    TokenizerFile over its tokenizer.json. ValueError when there is no
    such directory here, ImportError naming what to install when neither
    library is."""
    if not tokenizer_id:
        raise ValueError("get_tokenizer: the model's base has no tokenizer "
                         "(model_data.tokenizer_id is empty, as for "
                         "tally/demo's byte-level model)")
    if not os.path.isdir(tokenizer_id):
        raise ValueError(
            f"get_tokenizer: the tokenizer's directory {tokenizer_id!r} (the "
            f"base model's, on the server) is not readable here; load it "
            f"from a copy with transformers.AutoTokenizer.from_pretrained")
    transformers = _optional("transformers")
    if transformers is not None:
        return transformers.AutoTokenizer.from_pretrained(tokenizer_id)
    tokenizers = _optional("tokenizers")
    path = os.path.join(tokenizer_id, "tokenizer.json")
    if tokenizers is None:
        raise ImportError("get_tokenizer needs transformers (pip install "
                          "transformers) or tokenizers (pip install "
                          "tokenizers)")
    if not os.path.isfile(path):
        raise ValueError(f"get_tokenizer: {path} does not exist; without "
                         f"transformers only a tokenizer.json can be loaded")
    return TokenizerFile(tokenizers.Tokenizer.from_file(path))


class TokenizerFile:
    """A tokenizers.Tokenizer with the encode and decode calls of a
    transformers tokenizer (what a training loop uses of one)."""

    def __init__(self, tokenizer: Any) -> None:
        """`tokenizer`: a tokenizers.Tokenizer."""
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """The token ids of `text`."""
        return list(self.tokenizer.encode(
            text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: List[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids `ids`."""
        return str(self.tokenizer.decode(
            list(ids), skip_special_tokens=skip_special_tokens))


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
