"""A text source and an image-text source, small and real (Parquet, a trained tokenizer, JPEG images)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ["the", "a", "data", "loader", "reads", "pages", "of", "parquet", "and", "tokens", "flow", "to", "every", "rank", "while", "images", "are", "decoded", "into", "patches", "mixture", "weights", "change", "over", "steps"]


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 50, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>", "<|image|>"]))
    tok.save(str(path))


def write_text_and_images(root: Path, *, text_rows: int = 400, images: int = 48, side: int = 640) -> dict:
    """root/text (kind text), root/pairs (kind image_text: JPEG + caption), root/tok.json."""
    from PIL import Image

    rng = np.random.default_rng(7)
    root.mkdir(parents=True, exist_ok=True)
    write_tokenizer(root / "tok.json")
    (root / "text").mkdir(exist_ok=True)
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(50, 400)))) for _ in range(text_rows)]
    pq.write_table(pa.table({"text": docs}), root / "text" / "part-0.parquet", row_group_size=100)
    (root / "pairs").mkdir(exist_ok=True)
    blobs, caps = [], []
    yy, xx = np.mgrid[0:side, 0:side]
    for i in range(images):
        base = ((xx * (i + 1) + yy * 3) % 256).astype(np.uint8)
        a = np.stack([base, np.roll(base, i, 0), (base // 2 + rng.integers(0, 40, base.shape)).astype(np.uint8)], -1)
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="JPEG", quality=90)
        blobs.append(buf.getvalue())
        caps.append(" ".join(rng.choice(WORDS, size=8)))
    pq.write_table(pa.table({"image": blobs, "caption": caps}), root / "pairs" / "part-0.parquet", row_group_size=8)
    return {"text": str(root / "text"), "pairs": str(root / "pairs"), "tokenizer": str(root / "tok.json")}


def text_image_mixture(paths: dict, **runtime) -> dict:
    return {
        "name": "vlm-mix",
        "sources": [
            {"name": "text", "uri": paths["text"], "kind": "text", "tokenizer": paths["tokenizer"]},
            {"name": "pairs", "uri": paths["pairs"], "kind": "image_text", "columns": ["image", "caption"],
             "tokenizer": paths["tokenizer"], "image": {"patch_size": 14, "max_side": 224, "merge": 4}},
        ],
        "mixture": {"weights": {"text": 0.8, "pairs": 0.2}, "phases": [{"start_step": 100, "weights": {"text": 0.5, "pairs": 0.5}}]},
        "batch": {"sequences": 8, "seq_len": 512, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 2}, "encoder": {"dp": 2}}},
        "strategy": {"name": "vlm_balance"},
        "runtime": {"metrics": False, **runtime},
    }


class FakeKeys(dict):
    """Key pairs for every name asked (the roles' and any trainer pod's `client-r<A>-<B>`): fixed 40-char texts,
    so rendered Secrets are comparable; the operator makes real ones with zmq.curve_keypair."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str)

    def __missing__(self, name: str) -> tuple[str, str]:
        pair = (f"{name}-public-".ljust(40, "x")[:40], f"{name}-secret-".ljust(40, "y")[:40])
        self[name] = pair
        return pair
