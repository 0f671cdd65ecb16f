"""Token ids the whole data plane must agree on, resolved from the spec and the tokenizer file alone.

Loaders write image placeholders into the token stream and constructors look for them, so both
resolve the id here: plain JSON reading of a Hugging Face `tokenizers` file (no `tokenizers` import,
no loader code), with the same answers `Tokenizer.token_to_id` / `get_vocab_size` give.

Rule (spec field ``image.image_token_id``): the configured id; else the tokenizer's ``<|image|>``
(or ``<image>``, ``<|image_pad|>``); else vocab size - 1 (added tokens included).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache

IMAGE_TOKEN_CANDIDATES = ("<|image|>", "<image>", "<|image_pad|>")


@lru_cache(maxsize=32)
def _vocab(path: str, mtime_ns: int) -> dict[str, int]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        model_vocab = doc["model"]["vocab"]
        if isinstance(model_vocab, dict):  # BPE, WordPiece, WordLevel: {token: id}
            vocab = {str(t): int(i) for t, i in model_vocab.items()}
        elif isinstance(model_vocab, list):  # Unigram: [[token, score], ...], id = position
            vocab = {str(item[0]): i for i, item in enumerate(model_vocab)}
        else:
            raise TypeError(f"model.vocab is a {type(model_vocab).__name__}")
        # added tokens take precedence over the model's vocabulary (as in Tokenizer.token_to_id)
        vocab.update({str(t["content"]): int(t["id"]) for t in doc.get("added_tokens") or []})
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{path}: cannot read tokenizer ({type(e).__name__}: {e})") from None
    return vocab


def tokenizer_vocab(path: str) -> dict[str, int]:
    """Token -> id of a `tokenizers` JSON file, added tokens included (cached while the file is unchanged)."""
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError as e:
        raise ValueError(f"{path}: cannot read tokenizer ({e.strerror})") from None
    return _vocab(str(path), mtime)


def resolve_image_token_id(configured: int | None, tokenizer: str | None) -> int:
    """The image placeholder id of a source: ``image.image_token_id`` if set, else from its tokenizer file."""
    if configured is not None:
        return int(configured)
    if tokenizer is None:
        raise ValueError("image_text needs image.image_token_id or a tokenizer")
    vocab = tokenizer_vocab(tokenizer)
    for t in IMAGE_TOKEN_CANDIDATES:
        if t in vocab:
            return vocab[t]
    return len(vocab) - 1
