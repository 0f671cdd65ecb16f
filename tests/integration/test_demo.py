"""The demo data builder and the demo training job (quick mode) as users run them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from mixplane.demo.data import build_demo_data


def test_demo_data_is_real_and_deterministic(tmp_path):
    a = build_demo_data(tmp_path / "a", max_mb=0.5, vocab_size=512)
    b = build_demo_data(tmp_path / "b", max_mb=0.5, vocab_size=512)
    assert [s["name"] for s in a["sources"]] == ["code", "man", "docs"]
    for s in a["sources"]:
        files = sorted(Path(s["dir"]).glob("*.parquet"))
        assert len(files) >= 2 and s["documents"] > 0 and s["bytes"] >= 0.5 * 2**20
        md = pq.ParquetFile(files[0]).metadata
        assert md.row_group(0).column(2).has_offset_index  # page index written for page-level reads
        for f in files:
            assert f.read_bytes() == (tmp_path / "b" / s["name"] / f.name).read_bytes()
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    code = pq.read_table(tmp_path / "a" / "code", columns=["text"])["text"].to_pylist()
    assert any("def " in t for t in code)  # it is Python source


def test_quick_demo_trains_and_tracks_the_mixture(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mixplane.cli", "demo", "--quick", "--dir", str(tmp_path / "data")],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Realised per-source token fractions" in r.stdout and "worst mixture error" in r.stdout
    result = json.loads((tmp_path / "demo-run" / "demo-result.json").read_text())
    assert result["steps"] == 40 and result["ranks"] == 2
    assert [p["phase"] for p in result["phases"]] == [0, 1]
    assert result["phases"][1]["first_step"] == 20
    for ph in result["phases"]:
        for s in ph["sources"].values():
            assert abs(s["realized"] - s["target"]) < 0.01
    assert result["fill"] > 0.95
    first_loss = max(s["loss"] for s in result["phases"][0]["sources"].values())
    assert result["final_loss"] < first_loss  # it learns


def test_image_pairs_from_local_images(tmp_path):
    from mixplane.demo.data import build_image_pairs
    from mixplane.loader.stream import open_stream
    from mixplane.loader.transforms import make_transform
    from mixplane.spec import SourceSpec

    info = build_image_pairs(tmp_path / "pairs", max_images=40)
    assert info["images"] >= 10
    tok = build_demo_data(tmp_path / "d", max_mb=0.2, vocab_size=300)["tokenizer"]
    src = SourceSpec(name="pairs", uri=str(tmp_path / "pairs"), kind="image_text", columns=["image", "caption"],
                     tokenizer=tok, image={"patch_size": 14, "max_side": 224})
    out = make_transform(src)(open_stream(src, seed=0).take(info["images"]))
    assert (out.npatches > 0).all() and (out.ntokens > out.npatches).all()  # placeholders + caption tokens
