"""A loader that runs beside its trainer (sidecar placement) ends with it: real processes of an embedded run, a
loader host started as the pod webhook starts a sidecar (`--trainer-dir` of the pod's shared directory, its ranks and
restart policy) serving a partition handed to it, and trainer rank processes whose MixtureLoader marks that
directory (mixplane.podend). Clean end -> the loader exits 0; a crash under restartPolicy Never -> it exits
non-zero (the pod fails, its Job decides); a crash under OnFailure -> it serves on and the restarted rank, resuming
from its checkpoint, trains to the end on it, then it exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mixplane.podend import EXIT_TRAINER_FAILED
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.conftest import token_mixture

REPO = Path(__file__).resolve().parents[2]
STEPS = 12
HOST = "sidecar-0"
pytestmark = pytest.mark.timeout(600)

# a trainer rank process: `with MixtureLoader(...)` over STEPS steps, its state saved after every step (a
# restarted process resumes from it); CRASH_AT: raise after that many steps
TRAINER = textwrap.dedent("""
    import os, sys, time, pickle
    from mixplane.client import MixtureLoader
    rank, steps, crash_at = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    ckpt = os.path.join(sys.argv[4], f"state-{rank}.pkl")
    with MixtureLoader(rank=rank, world_size=2, max_steps=steps, timeout_s=90) as loader:
        if os.path.exists(ckpt):
            with open(ckpt, "rb") as f:  # a local checkpoint file of this test, never a socket
                loader.load_state_dict(pickle.load(f))
            print("resumed", loader.next_step, flush=True)
        for batch in loader:
            print("step", int(batch["step"]), flush=True)
            with open(ckpt + ".tmp", "wb") as f:
                pickle.dump(loader.state_dict(), f)
            os.replace(ckpt + ".tmp", ckpt)
            time.sleep(0.1)
            if int(batch["step"]) + 1 == crash_at:
                raise RuntimeError("the training step failed")
""")


def start_sidecar(rt: EmbeddedRuntime, pod_dir: Path, restart: str, log: Path) -> subprocess.Popen:
    """A loader host as the pod webhook makes a sidecar of it (not supervised by the runtime: its end is the test)."""
    args = [sys.executable, "-m", "mixplane.cli", "--log-level", "INFO", "loader", "--spec", rt.plan().target.spec_file,
            "--host-name", HOST, "--planner", rt.planner_endpoint or "", "--trainer-dir", str(pod_dir),
            "--trainer-ranks", "0-1", "--trainer-restart", restart, "--trainer-quiet-s", "1", "--trainer-gone-s", "3"]
    if rt.key_dir:
        args += ["--curve-dir", str(rt.key_dir)]
    with open(log, "wb") as out:
        return subprocess.Popen(args, env={**os.environ, "PYTHONPATH": str(REPO / "src")}, stdout=out,
                                stderr=subprocess.STDOUT)


def start_rank(rt: EmbeddedRuntime, pod_dir: Path, rank: int, crash_at: int, ckpt: Path) -> subprocess.Popen:
    env = {**os.environ, **rt.client_env(), "MIXPLANE_POD_DIR": str(pod_dir), "PYTHONPATH": str(REPO / "src")}
    return subprocess.Popen([sys.executable, "-c", TRAINER, str(rank), str(STEPS), str(crash_at), str(ckpt)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(pred, timeout_s: float, what: str, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while not (v := pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)
    return v


def finish(p: subprocess.Popen, timeout_s: float = 180) -> tuple[int, str]:
    out, _ = p.communicate(timeout=timeout_s)
    return p.returncode, out


@pytest.mark.parametrize("restart,crash", [("Never", False), ("Never", True), ("OnFailure", True)])
def test_a_sidecar_loader_ends_with_its_trainer(token_sources, tmp_path, restart, crash):
    spec = parse_spec(token_mixture(token_sources["root"], runtime={"window": 64, "metrics": False}))
    pod_dir, ckpt = tmp_path / "pod", tmp_path / "ckpt"
    pod_dir.mkdir()
    ckpt.mkdir()
    log = tmp_path / "sidecar.log"
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        side = start_sidecar(rt, pod_dir, restart, log)
        try:
            wait_for(lambda: rt.partitions().get("hosts", {}).get(HOST, {}).get("alive") or side.poll() is not None,
                     120, "the sidecar loader to register")
            assert side.poll() is None, log.read_text()[-3000:]
            moved = rt.handoff("a:0", HOST)  # it serves a partition the trainers need, as a sidecar does
            assert moved["to"] == HOST
            ranks = {r: start_rank(rt, pod_dir, r, 4 if crash and r == 1 else 0, ckpt) for r in (0, 1)}
            code0, out0 = finish(ranks[0])
            assert code0 == 0 and f"step {STEPS - 1}" in out0, out0[-3000:]
            assert rt.partitions()["partitions"]["a:0"]["host"] == HOST
            code1, out1 = finish(ranks[1])
            if not crash:
                assert code1 == 0 and f"step {STEPS - 1}" in out1, out1[-3000:]
                side.wait(60)
                assert side.returncode == 0, log.read_text()[-3000:]
                assert "trainer ranks 0-1 of this pod ended cleanly" in log.read_text()
                return
            assert code1 == 1 and "the training step failed" in out1, out1[-3000:]
            if restart == "Never":  # nothing restarts rank 1 in this pod: the loader fails (3 s without a rank)
                side.wait(60)
                assert side.returncode == EXIT_TRAINER_FAILED, log.read_text()[-3000:]
                text = log.read_text()
                assert "rank 1 ended" in text and "ended without a clean close: rank 1 x1" in text, text[-3000:]
                return
            # OnFailure: the kubelet would start the trainer container again in the same pod; the loader serves on
            time.sleep(5)  # longer than --trainer-gone-s: it must not have given up
            assert side.poll() is None, log.read_text()[-3000:]
            again = start_rank(rt, pod_dir, 1, 0, ckpt)
            code1, out1 = finish(again)
            assert code1 == 0 and "resumed 4" in out1 and f"step {STEPS - 1}" in out1, out1[-3000:]
            side.wait(60)
            assert side.returncode == 0, log.read_text()[-3000:]
            assert "ended without a clean close: rank 1 x1" in log.read_text()
        finally:
            if side.poll() is None:
                side.kill()
                side.wait(30)
