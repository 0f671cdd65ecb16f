"""The planner server's fan-out to many peers: simulated loaders and constructors over real ZeroMQ on
127.0.0.1 (bench/plan_peers.py; the full 1,024 + 512 peers x 100 steps run is the benchmark)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_plan_reaches_every_simulated_peer():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_peers.py"), "--loaders", "96", "--constructors", "48",
                          "--steps", "12", "--procs", "2,1", "--timeout", "150"],
                         capture_output=True, text=True, timeout=200, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["steps"] == 12 and row["peers"] == 144
    assert row["undeliverable"] == 0 and row["bad_messages"] == 0 and row["errors"] == []
    assert row["delivered_equals_sent"] and row["every_constructor_every_step"]
    assert row["spans_match"]  # loaders were told to send exactly what constructors were told to expect
    assert row["peers_complete"] == 144
    assert row["plan_messages"] >= 12 * 48  # every constructor every step, plus the loaders' plans
    assert row["ok"]
