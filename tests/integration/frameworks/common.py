"""What the framework tests share: a mixture over the `token_sources` fixture with lr_scale phases, torchrun
launches of a trainer script, and the per-rank records those scripts write (one JSON line per microbatch)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from mixplane.mixing import MixtureSchedule
from mixplane.spec import parse_spec
from tests.conftest import token_mixture

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
STEPS, SAVE_AT, DIE_AT = 8, 4, 6
PHASES = [{"start_step": 3, "weights": {"a": 0.2, "b": 0.3, "c": 0.5}, "lr_scale": 0.5},
          {"start_step": 6, "weights": {"a": 0.6, "b": 0.2, "c": 0.2}, "lr_scale": 0.25}]


def spec(root: Path, dp: int):
    return parse_spec(token_mixture(root, mixture={"weights": {"a": 0.5, "b": 0.3, "c": 0.2}, "seed": 7, "phases": PHASES},
                                    topology={"modules": {"backbone": {"dp": dp}}},
                                    runtime={"window": 64, "metrics": False}))


def lr_scale_at(sp, step: int) -> float:
    return float(MixtureSchedule(sp).at(step).lr_scale)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, nproc: int, args: list[str], env: dict[str, str], log: Path, timeout_s: float = 240) -> int:
    """Run `script` under the real torchrun (static rendezvous on loopback); its exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
           str(HERE / script), *args]
    full = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as out:
        p = subprocess.Popen(cmd, env=full, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
            raise AssertionError(f"{script} did not finish within {timeout_s}s; log {log}:\n{log.read_text()[-4000:]}") from None


def records(path: Path, ranks: int) -> dict[int, list[dict]]:
    """{rank: [record, ...]} from rec-rank{R}.jsonl files (complete lines only: a killed writer may leave half a line)."""
    out: dict[int, list[dict]] = {}
    for r in range(ranks):
        f = path / f"rec-rank{r}.jsonl"
        lines = f.read_text().split("\n") if f.exists() else []
        out[r] = [json.loads(line) for line in lines[:-1] if line]
    return out


def rows_by_step(recs: dict[int, list[dict]]) -> dict[int, np.ndarray]:
    """What the whole job trained on per mixture step: every rank's microbatch tokens, in rank then microbatch order
    (the last time each (rank, step, microbatch) was recorded: a killed run's lost steps are trained again)."""
    last: dict[tuple[int, int, int], list[int]] = {}
    for r, rs in recs.items():
        for x in (x for x in rs if "ids" in x):
            last[(x["step"], r, x["mb"])] = x["ids"]
    steps = sorted({k[0] for k in last})
    return {s: np.concatenate([np.asarray(last[k], dtype=np.int64) for k in sorted(last) if k[0] == s]) for s in steps}
