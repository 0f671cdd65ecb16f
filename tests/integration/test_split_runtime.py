"""overlong_doc: split through a real run (processes + ZeroMQ): every piece of a giant document reaches
the trainer, each piece once, and the loader counts the split document."""

from __future__ import annotations

import urllib.request

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mixplane.loader.split import PIECE_SHIFT, piece_bounds
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.integration.test_runtime import fetch

pytestmark = pytest.mark.timeout(300)
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "hello", "world"]
GIANT_ROW = 7
MAX_BYTES = 2000


def test_every_piece_of_a_giant_document_reaches_the_trainer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 5, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"]))
    tok.save(str(tmp_path / "tok.json"))
    rng = np.random.default_rng(3)
    texts = [" ".join(rng.choice(WORDS, 6 + i % 5).tolist()) for i in range(60)]
    texts[GIANT_ROW] = " ".join(rng.choice(WORDS, 5000).tolist())  # ~30 KB: 15+ pieces of <= 2000 bytes
    (tmp_path / "src").mkdir()
    pq.write_table(pa.table({"text": texts}), tmp_path / "src" / "t.parquet")
    pieces = len(piece_bounds(texts[GIANT_ROW].encode(), MAX_BYTES))
    spec = parse_spec({
        "name": "split",
        "sources": [{"name": "t", "uri": str(tmp_path / "src"), "tokenizer": str(tmp_path / "tok.json"),
                     "shuffle": "sequential", "max_doc_bytes": MAX_BYTES, "overlong_doc": "split"}],
        "mixture": {"weights": {"t": 1.0}, "seed": 1},
        "batch": {"sequences": 4, "seq_len": 128, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 1}}},
        "runtime": {"window": 8, "metrics": True},
    })
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        got = fetch(rt.planner_endpoint, 1, 24)[0]
        loader = next(c for n, c in rt.endpoints()["components"].items() if n.startswith("loader"))
        text = urllib.request.urlopen(f"http://127.0.0.1:{loader['metrics_port']}/metrics", timeout=10).read().decode()
        assert not rt.dead(), rt.dead()
    keys = np.concatenate([b["segment_key"] for b in got])
    mask = (1 << PIECE_SHIFT) - 1
    giant = sorted({0} | {int(-k) >> PIECE_SHIFT for k in keys.tolist() if k < 0 and (int(-k) & mask) == GIANT_ROW})
    assert GIANT_ROW in keys.tolist()  # piece 0 keeps the row's key
    assert giant == list(range(pieces)), (giant, pieces)  # every piece delivered
    assert any(line.startswith('mixplane_loader_overlong_docs_total{action="split"') and float(line.split()[-1]) >= 1
               for line in text.splitlines()), text[-2000:]
