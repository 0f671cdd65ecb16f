"""Where images are decoded (image.decode_at): loader, constructor or client give bit-identical batches on real
embedded runs; the place is in the run's spec and the planner's journal and a replay plans the same steps with it;
a bad image names its source, file and row wherever it is decoded."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mixplane.client import MixtureLoader
from mixplane.planner.journal import read_journal, replan
from mixplane.replay import ReplayLoaders
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.integration.test_transport_multimodal import _tokenizer

pytestmark = pytest.mark.timeout(240)
P, MAX_SIDE, MERGE, STEPS = 14, 112, 4, 4


def _jpeg(rng, h, w) -> bytes:
    from PIL import Image

    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([(x * 255 // w), (y * 255 // h), rng.integers(0, 255, (h, w))], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def _data(tmp_path, n=24, bad_row=None):
    rng = np.random.default_rng(1)
    tok = tmp_path / "tok.json"
    if not tok.exists():
        _tokenizer(tok)
    # larger than max_side (JPEG draft + bicubic resize on every path), PNG too
    images = [_jpeg(rng, int(rng.integers(150, 400)), int(rng.integers(150, 400))) for _ in range(n)]
    if bad_row is not None:
        images[bad_row] = images[bad_row][: len(images[bad_row]) // 2]  # the header reads, the pixels do not
    caps = [" ".join(rng.choice(["a", "small", "red", "square", "cat", "dog"], size=int(rng.integers(1, 6)))) for _ in range(n)]
    path = tmp_path / ("vlm.parquet" if bad_row is None else "bad.parquet")
    pq.write_table(pa.table({"image": images, "caption": caps}), path, row_group_size=8)
    return path, tok


def _spec(tmp_path, path, tok, place, run):
    return parse_spec({
        "name": "decode-place",
        "sources": [{"name": "vlm", "uri": str(path), "kind": "image_text", "columns": ["image", "caption"],
                     "tokenizer": str(tok), "image": {"patch_size": P, "max_side": MAX_SIDE, "merge": MERGE,
                                                      "decode_at": place}}],
        "batch": {"sequences": 2, "seq_len": 96, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 2}}},
        "strategy": {"name": "vanilla"},
        "runtime": {"window": 16, "metrics": False, "run_dir": str(tmp_path / run)},
    })


def _run(spec, run_dir, steps=STEPS):
    out = []
    with EmbeddedRuntime(spec, run_dir, log_level="WARNING") as rt:
        assert rt.spec.sources[0].image.decode_at == spec.sources[0].image.decode_at
        loaders = [MixtureLoader(rt.planner_endpoint, rank=r, timeout_s=60, max_steps=steps) for r in range(2)]
        try:
            for _ in range(steps):
                out.append([{k: v.numpy() for k, v in next(l).items()} for l in loaders])
            decode_cpu = sum(l.image_decode_cpu_s for l in loaders)
            received = sum(l.received_bytes for l in loaders)
        finally:
            for l in loaders:
                l.close()
    return out, decode_cpu, received


def test_batches_identical_wherever_images_are_decoded(tmp_path):
    path, tok = _data(tmp_path)
    runs, received = {}, {}
    for place in ("loader", "constructor", "client"):
        spec = _spec(tmp_path, path, tok, place, place)
        runs[place], cpu, received[place] = _run(spec, tmp_path / place)
        assert (cpu > 0) == (place == "client")  # only a client-side decode costs the client CPU
        opened = [r for r in read_journal(tmp_path / place / "journal.jsonl") if r["event"] == "open"]
        assert opened[0]["spec"]["sources"][0]["image"]["decode_at"] == place  # the choice is journaled
    # the clients receive pixels unless they decode (JPEGs: raw bytes are a fraction of the pixels)
    assert received["loader"] == received["constructor"] > received["client"], received
    base = runs["loader"]
    assert sum(len(b["image_ids"]) for step in base for b in step) > 0
    for place in ("constructor", "client"):
        for s, (want, got) in enumerate(zip(base, runs[place])):
            for r, (a, b) in enumerate(zip(want, got)):
                assert sorted(a) == sorted(b), (place, s, r)
                for k in a:
                    assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), (place, s, r, k)
    # a replay plans every step again from the journal, with the journaled place (digests checked)
    with ReplayLoaders() as loaders:
        assert loaders is not None
        for step in range(STEPS):
            plan = replan(tmp_path / "constructor" / "journal.jsonl", step, loaders)
            assert plan.layout.step == step


def test_a_truncated_image_is_quarantined_blank_and_named_identically_wherever_it_is_decoded(tmp_path):
    """An image whose header reads but whose pixels do not (a truncated file) is delivered as zeros of its planned
    grid with image_quarantined 1, the stream goes on, and the place that decoded it names its source, file and row:
    the batches of the three places are the same, tensor for tensor."""
    bad_row, steps = 5, 6
    path, tok = _data(tmp_path, n=8, bad_row=bad_row)
    runs, clients = {}, {}
    for place in ("loader", "constructor", "client"):
        spec = _spec(tmp_path, path, tok, place, place)
        with EmbeddedRuntime(spec, tmp_path / place, log_level="WARNING") as rt:
            loaders = [MixtureLoader(rt.planner_endpoint, rank=r, timeout_s=60, max_steps=steps) for r in range(2)]
            try:
                runs[place] = [[{k: v.numpy().copy() for k, v in next(l).items()} for l in loaders] for _ in range(steps)]
                clients[place] = [q for l in loaders for q in l.quarantined_images]
            finally:
                for l in loaders:
                    l.close()
    for step in range(steps):
        for r in range(2):
            a = runs["loader"][step][r]
            for place in ("constructor", "client"):
                b = runs[place][step][r]
                assert set(a) == set(b), (place, step, r)
                for k in a:
                    assert np.array_equal(a[k], b[k]), f"{place} step {step} rank {r}: {k}"
    flagged = 0
    for step in range(steps):
        for b in runs["loader"][step]:
            q = b.get("image_quarantined")
            if q is None or not q.any():
                continue
            cu = b["patch_cu_seqlens"]
            for i in np.flatnonzero(q):
                flagged += 1
                assert not b["pixel_patches"][cu[i]:cu[i + 1]].any()  # zeros of its grid
                assert cu[i + 1] > cu[i]
    assert flagged >= 1  # the truncated image was delivered, blank and flagged
    where = f"file {path}, row {bad_row}"
    assert clients["client"] and all(where in e and "undecodable image" in e for _, e in clients["client"])
    assert not clients["loader"] and not clients["constructor"]
    logs = {place: "".join(f.read_text(errors="replace") for f in (tmp_path / place / "logs").glob("*.log"))
            for place in runs}
    assert where in logs["constructor"] and "quarantined, delivered as zeros" in logs["constructor"], logs["constructor"][-3000:]
    assert "undecodable image pixels" in logs["loader"] and f"row {bad_row}" in logs["loader"], logs["loader"][-3000:]


def test_auto_is_resolved_at_start_and_journaled(tmp_path):
    from mixplane.imagedecode import PLACES

    path, tok = _data(tmp_path, n=8)
    spec = _spec(tmp_path, path, tok, "auto", "auto")
    with EmbeddedRuntime(spec, tmp_path / "auto", log_level="WARNING") as rt:
        chosen = rt.spec.sources[0].image.decode_at
    assert chosen in PLACES
    opened = [r for r in read_journal(tmp_path / "auto" / "journal.jsonl") if r["event"] == "open"]
    assert opened[0]["spec"]["sources"][0]["image"]["decode_at"] == chosen


def test_a_run_restarted_in_its_run_directory_keeps_the_journaled_place(tmp_path):
    from mixplane.runtime import journaled_decode_places

    path, tok = _data(tmp_path, n=8)
    with EmbeddedRuntime(_spec(tmp_path, path, tok, "client", "run"), tmp_path / "run", log_level="WARNING"):
        pass
    # the same run directory again with auto: the place the journal recorded, not a new measurement's
    with EmbeddedRuntime(_spec(tmp_path, path, tok, "auto", "run"), tmp_path / "run", log_level="WARNING") as rt:
        assert rt.spec.sources[0].image.decode_at == "client"
    kept = sorted((tmp_path / "run" / "journals").glob("*.jsonl"))
    assert len(kept) == 1 and journaled_decode_places(str(kept[0])) == {"vlm": "client"}
    opened = [r for r in read_journal(tmp_path / "run" / "journal.jsonl") if r["event"] == "open"]
    assert opened[0]["spec"]["sources"][0]["image"]["decode_at"] == "client"
