"""Several Source Loaders in one process (source grouping) serve a mixture like separate loaders do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mixplane.client import MixtureLoader
from mixplane.runtime import EmbeddedRuntime

from .test_transport_runtime import check_rows, make_sources, spec_for

pytestmark = pytest.mark.timeout(180)
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _spawn(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_grouped_loaders_deliver_the_same_batches_as_separate_loaders(tmp_path):
    paths = make_sources(tmp_path, 3, docs=40, max_len=90)
    spec = spec_for(paths, tmp_path, seq_len=64, sequences=2, topo={"dp": 1}, window=16)
    # reference: the embedded runtime, one process per loader
    with EmbeddedRuntime(spec, tmp_path / "ref", log_level="WARNING") as rt:
        ref = [{k: v.clone() for k, v in b.items()}
               for b in MixtureLoader(rt.planner_endpoint, rank=0, timeout_s=60, max_steps=4)]
    # the same mixture with all three sources in one loader process
    run = tmp_path / "grouped"
    run.mkdir()
    spec_file = run / "spec.json"
    spec_file.write_text(spec.model_dump_json())
    procs = []
    try:
        ready = run / "planner.ready"
        procs.append(_spawn("-m", "mixplane.cli", "planner", "--spec", str(spec_file), "--ready-file", str(ready),
                            "--run-dir", str(run)))
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, "planner did not start"
            time.sleep(0.05)
        ep = json.loads(ready.read_text())["endpoint"]
        procs.append(_spawn("-m", "mixplane.cli", "constructor", "--spec", str(spec_file), "--index", "0", "--planner", ep))
        procs.append(_spawn("-m", "mixplane.cli", "loader", "--spec", str(spec_file), "--planner", ep,
                            "--sources", "s0,s1,s2"))
        got = [{k: v.clone() for k, v in b.items()} for b in MixtureLoader(ep, rank=0, timeout_s=60, max_steps=4)]
        assert len(procs) == 3 and all(p.poll() is None for p in procs)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    assert len(got) == len(ref) == 4
    for g, r in zip(got, ref):
        assert g.keys() == r.keys()
        for k in g:
            assert (g[k] == r[k]).all(), k
        check_rows(g["input_ids"].numpy(), g["labels"].numpy(), g["position_ids"].numpy(), g["cu_seqlens"].numpy(), 64)
