"""The embedded runtime: every component of one mixture as a local process, talking ZeroMQ.

The same component entrypoints (`mixplane planner|loader|constructor`) run in pods; here they
are children of this process, die with it (PR_SET_PDEATHSIG), and stop on SIGTERM/SIGINT.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from mixplane import wire
from mixplane.spec import DataMixtureSpec
from mixplane.topology import constructor_groups
from mixplane.wire import Kind

log = logging.getLogger("mixplane.runtime")
READY_TIMEOUT_S = 120.0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    ready_file: Path
    info: dict[str, Any] = field(default_factory=dict)


def loader_groups(spec: DataMixtureSpec) -> list[list[tuple[str, int]]]:
    """(source, replica) pairs hosted together, `runtime.sources_per_loader` per process, in spec order."""
    pairs = [(s.name, r) for s in spec.sources for r in range(s.replicas)]
    n = spec.runtime.sources_per_loader
    return [pairs[i : i + n] for i in range(0, len(pairs), n)]


def default_run_dir(spec: DataMixtureSpec) -> Path:
    return Path(spec.runtime.run_dir or os.path.join(".mixplane", spec.name)).resolve()


class EmbeddedRuntime:
    """Start planner, constructors and loaders as processes; `stop()` leaves none behind."""

    def __init__(self, spec: DataMixtureSpec, run_dir: str | os.PathLike | None = None, *, python: str | None = None,
                 log_level: str = "INFO"):
        self.spec = spec
        self.run_dir = Path(run_dir).resolve() if run_dir else default_run_dir(spec)
        self.python = python or sys.executable
        self.log_level = log_level
        self.children: list[Child] = []
        self.planner_endpoint: str | None = None

    # -- start ----------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> Child:
        ready = self.run_dir / "ready" / f"{name}.json"
        ready.unlink(missing_ok=True)
        logf = open(self.run_dir / "logs" / f"{name}.log", "ab")
        cmd = [self.python, "-m", "mixplane.cli", "--log-level", self.log_level, *args, "--ready-file", str(ready)]
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        logf.close()
        c = Child(name, proc, ready)
        self.children.append(c)
        return c

    def _wait_ready(self, children: list[Child]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for c in children:
            while not c.ready_file.exists():
                if c.proc.poll() is not None:
                    tail = (self.run_dir / "logs" / f"{c.name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} while starting:\n{tail}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{c.name} not ready after {READY_TIMEOUT_S:.0f}s (log: {self.run_dir / 'logs' / (c.name + '.log')})")
                time.sleep(0.02)
            c.info = json.loads(c.ready_file.read_text())

    def start(self) -> "EmbeddedRuntime":
        for sub in ("ready", "logs"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        (self.run_dir / "journal.jsonl").unlink(missing_ok=True)
        if self.spec.runtime.curve.enabled and self.spec.runtime.curve.key_dir:
            wire.ensure_keys(self.spec.runtime.curve.key_dir)  # server + client key pairs, once
        spec_file = self.run_dir / "spec.json"
        spec_file.write_text(self.spec.model_dump_json(indent=1))
        try:
            host = self.spec.runtime.host
            planner = self._spawn("planner", ["planner", "--spec", str(spec_file),
                                              "--bind", f"tcp://{host}:{self.spec.runtime.planner_port or '*'}",
                                              "--run-dir", str(self.run_dir)])
            self._wait_ready([planner])
            self.planner_endpoint = planner.info["endpoint"]
            rest = []
            for i in range(len(constructor_groups(self.spec))):
                rest.append(self._spawn(f"constructor-{i}", ["constructor", "--spec", str(spec_file), "--index", str(i),
                                                             "--planner", self.planner_endpoint]))
            for group in loader_groups(self.spec):
                if len(group) == 1:
                    name, r = group[0]
                    rest.append(self._spawn(f"loader-{name}-{r}", ["loader", "--spec", str(spec_file), "--source", name,
                                                                   "--replica", str(r), "--planner", self.planner_endpoint]))
                else:
                    members = ",".join(f"{n}:{r}" for n, r in group)
                    rest.append(self._spawn(f"loaders-{group[0][0]}-{group[0][1]}+{len(group) - 1}",
                                            ["loader", "--spec", str(spec_file), "--sources", members, "--planner", self.planner_endpoint]))
            self._wait_ready(rest)
            (self.run_dir / "endpoints.json").write_text(json.dumps(self.endpoints(), indent=1))
        except BaseException:
            self.stop()
            raise
        return self

    def endpoints(self) -> dict[str, Any]:
        return {"planner": self.planner_endpoint, "run_dir": str(self.run_dir),
                "components": {c.name: {**c.info, "pid": c.proc.pid} for c in self.children}}

    # -- control --------------------------------------------------------------------------
    def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        return request(self.planner_endpoint or "", Kind.STATUS, {}, timeout_s, curve=self.spec.runtime.curve)

    def alive(self) -> list[str]:
        return [c.name for c in self.children if c.proc.poll() is None]

    def dead(self) -> list[tuple[str, int]]:
        return [(c.name, c.proc.returncode) for c in self.children if c.proc.poll() is not None]

    def stop(self, timeout_s: float = 10.0) -> None:
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in self.children:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(5)

    def __enter__(self) -> "EmbeddedRuntime":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def request(endpoint: str, kind: Kind, meta: dict[str, Any], timeout_s: float = 5.0, *, curve: Any = None) -> dict[str, Any]:
    """One request/reply with the planner (status, mixture updates); raises on timeout or error.

    `curve`: the spec's runtime.curve, when the planner requires CURVE."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    wire.Security(ctx, curve).client(s)
    try:
        s.connect(endpoint)
        wire.send(s, kind, meta)
        if not s.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from the planner at {endpoint} within {timeout_s:.0f}s")
        _, msg = wire.recv(s)
        if msg.kind == Kind.ERROR:
            raise RuntimeError(str(msg.meta.get("error")))
        return msg.meta
    finally:
        s.close(0)


def write_ready(path: str | None, info: dict[str, Any]) -> None:
    """Atomically announce a component's endpoints to whoever started it."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({**info, "pid": os.getpid()}, f)
    os.replace(tmp, path)
