"""`mixplane run` supervision (issue 22 item 2): by default a component that dies is restarted (supervision
runs on its own thread, so a planner restart does not wait for the progress loop's status request), and the
ranks' batches stay those of a failure-free run; `--fail-fast` stops the run at the first crash."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import yaml

from mixplane.client import MixtureLoader
from mixplane.control import control_curve, status
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.conftest import token_mixture

STEPS = 60


def start_cli(doc: dict, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, dict]:
    f = tmp_path / "mix.yaml"
    f.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    log = open(tmp_path / "cli.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mixplane.cli", "run", str(f), "--run-dir", str(run_dir), *extra],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not (run_dir / "endpoints.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "cli.log").read_text()
        time.sleep(0.05)
    return proc, run_dir, json.loads((run_dir / "endpoints.json").read_text())


def pid_of(run_dir: Path, name: str) -> int:
    return int(json.loads((run_dir / "endpoints.json").read_text())["components"][name]["pid"])


def fetch(endpoint: str, curve_dir: str | None, pause_s: float, out: dict, errors: list) -> list[threading.Thread]:
    def work(r: int) -> None:
        try:
            from mixplane import wire

            curve = wire.CurveSetup.from_dir(curve_dir, "client") if curve_dir else None
            for b in MixtureLoader(endpoint, rank=r, max_steps=STEPS, timeout_s=120, curve=curve):
                out[r].append(b["input_ids"].numpy().copy())
                time.sleep(pause_s)
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            errors.append(e)

    ts = [threading.Thread(target=work, args=(r,), daemon=True) for r in (0, 1)]
    for t in ts:
        t.start()
    return ts


def test_mixplane_run_restarts_a_dead_planner_and_constructor_by_default(token_sources, tmp_path):
    doc = token_mixture(token_sources["root"])
    with EmbeddedRuntime(parse_spec(doc), tmp_path / "ref") as rt:
        ref: dict[int, list] = {0: [], 1: []}
        errs: list = []
        for t in fetch(rt.planner_endpoint, str(rt.key_dir) if rt.key_dir else None, 0, ref, errs):
            t.join(120)
        assert not errs, errs
    proc, run_dir, eps = start_cli(doc, tmp_path)  # no flag: the documented default
    try:
        curve = control_curve(run_dir=run_dir)
        got: dict[int, list] = {0: [], 1: []}
        errors: list = []
        threads = fetch(eps["planner"], eps.get("key_dir"), 0.05, got, errors)
        for name in ("planner", "constructor-0"):
            deadline = time.monotonic() + 60
            while min(len(v) for v in got.values()) < (10 if name == "planner" else 30):
                assert not errors and time.monotonic() < deadline, errors
                time.sleep(0.02)
            old = pid_of(run_dir, name)
            before = status(eps["planner"], 5, curve=curve)["incarnation"]
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while pid_of(run_dir, name) == old:  # restarted (endpoints.json is rewritten after each restart)
                assert proc.poll() is None, (tmp_path / "cli.log").read_text()
                assert time.monotonic() < deadline, f"{name} not restarted: " + (tmp_path / "cli.log").read_text()
                time.sleep(0.05)
            if name == "planner":
                assert status(eps["planner"], 10, curve=curve)["incarnation"] != before
        for t in threads:
            t.join(180)
        assert not errors, [str(e) for e in errors]
        assert proc.poll() is None, "mixplane run stopped"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    cli_log = (tmp_path / "cli.log").read_text()
    assert "restarted planner" in cli_log and "restarted constructor-0" in cli_log
    for r in (0, 1):
        assert len(got[r]) == STEPS
        assert all(np.array_equal(a, b) for a, b in zip(got[r], ref[r])), f"rank {r}: batches differ from the failure-free run"


def test_mixplane_run_fail_fast_stops_at_the_first_crash(token_sources, tmp_path):
    proc, run_dir, _ = start_cli(token_mixture(token_sources["root"]), tmp_path, "--fail-fast")
    try:
        os.kill(pid_of(run_dir, "constructor-1"), signal.SIGKILL)
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "constructor-1 exited with code -9" in (tmp_path / "cli.log").read_text()
