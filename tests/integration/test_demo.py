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


def test_demo_data_is_rebuilt_when_its_parameters_change(tmp_path):
    from mixplane.demo.data import build_params, ensure_demo_data

    d = tmp_path / "data"
    assert ensure_demo_data(d, max_mb=0.1, vocab_size=300)
    summary = json.loads((d / "SUMMARY.json").read_text())
    assert summary["params"] == build_params(max_mb=0.1, vocab_size=300, tokenizer_mb=6.0)
    small = sum(s["bytes"] for s in summary["sources"])
    stamp = (d / "SUMMARY.json").stat().st_mtime_ns
    assert not ensure_demo_data(d, max_mb=0.1, vocab_size=300)  # same build: reused
    assert (d / "SUMMARY.json").stat().st_mtime_ns == stamp
    assert ensure_demo_data(d, max_mb=0.25, vocab_size=300)  # a bigger build: rebuilt, not reused
    bigger = json.loads((d / "SUMMARY.json").read_text())
    assert bigger["params"]["max_mb"] == 0.25 and sum(s["bytes"] for s in bigger["sources"]) > small
    del bigger["params"]  # a summary from before parameters were recorded
    (d / "SUMMARY.json").write_text(json.dumps(bigger))
    assert ensure_demo_data(d, max_mb=0.25, vocab_size=300)


def test_demo_data_command(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mixplane.cli", "demo-data", str(tmp_path / "d"), "--max-mb", "0.1", "--vocab", "300"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [s["name"] for s in out["sources"]] == ["code", "man", "docs"]
    assert out["params"]["max_mb"] == 0.1 and out["vocab_size"] == 300
    assert json.loads((tmp_path / "d" / "SUMMARY.json").read_text()) == out
    assert all(sorted((tmp_path / "d" / s["name"]).glob("*.parquet")) for s in out["sources"])


def _processes_mentioning(text: str) -> list[int]:
    """Pids of live processes (not zombies) whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            found.append(int(entry.name))
    return found


def test_sigterm_to_the_demo_stops_every_trainer(tmp_path):
    import os
    import signal
    import time

    data = tmp_path / "data"
    parent = subprocess.Popen([sys.executable, "-m", "mixplane.cli", "demo", "--dir", str(data), "--max-mb", "0.2",
                               "--steps", "2000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        trainers: list[int] = []
        while len(trainers) < 2 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.2)
            trainers = [p for p in _processes_mentioning("mixplane.demo.train") if p in _processes_mentioning(str(tmp_path))]
        assert len(trainers) == 2, f"trainers did not start: {parent.poll()} {parent.stderr.read() if parent.poll() is not None else ''}"
        time.sleep(1.0)  # trainers are running: connected or connecting to the data plane
        os.kill(parent.pid, signal.SIGTERM)
        assert parent.wait(timeout=60) == 128 + signal.SIGTERM
        left = _processes_mentioning(str(tmp_path))  # trainers and data-plane components all name the demo dirs
        assert left == [], f"processes left behind: {left}"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in _processes_mentioning(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
