"""The embedded runtime: the launch plan of one mixture as supervised local processes.

`mixplane.launch` decides which components run with which arguments (the operator renders the same
plan into pods); this module only starts them as children of this process, waits for their ready
files, notices when one dies and stops them all. Children die with this process (PR_SET_PDEATHSIG)
and stop on SIGTERM/SIGINT. Requests to the running planner live in `mixplane.control`.
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

from mixplane import wire
from mixplane.control import ENDPOINTS_FILE, default_run_dir, read_ready, request
from mixplane.planner import journal
from mixplane.launch import Component, LaunchPlan, LaunchTarget, launch_plan
from mixplane.spec import DataMixtureSpec
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
    component: Component | None = None


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
    def target(self) -> LaunchTarget:
        return LaunchTarget.local(self.spec, str(self.run_dir))

    def plan(self) -> LaunchPlan:
        """What `start` runs (the planner endpoint is filled in once the planner announced it)."""
        return launch_plan(self.spec, self.target())

    def _spawn(self, comp: Component) -> Child:
        ready = Path(comp.ready_file)
        ready.unlink(missing_ok=True)
        logf = open(self.run_dir / "logs" / f"{comp.name}.log", "ab")
        cmd = [self.python, "-m", "mixplane.cli", "--log-level", self.log_level, *comp.args]
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent, env={**os.environ, **comp.env})
        logf.close()
        c = Child(comp.name, proc, ready, component=comp)
        self.children.append(c)
        return c

    def _wait_ready(self, children: list[Child]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for c in children:
            while (info := read_ready(c.ready_file)) is None:
                if c.proc.poll() is not None:
                    tail = (self.run_dir / "logs" / f"{c.name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} while starting:\n{tail}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{c.name} not ready after {READY_TIMEOUT_S:.0f}s (log: {self.run_dir / 'logs' / (c.name + '.log')})")
                time.sleep(0.02)
            c.info = info

    def start(self) -> "EmbeddedRuntime":
        for sub in ("ready", "logs"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        # the planner journal of an earlier run in this directory is kept (journals/), never deleted
        kept = journal.rotate(self.run_dir / "journal.jsonl")
        if kept:
            log.info("previous journal kept as %s", kept)
        if self.spec.runtime.curve.enabled and self.spec.runtime.curve.key_dir:
            wire.ensure_keys(self.spec.runtime.curve.key_dir)  # server + client key pairs, once
        plan = self.plan()
        Path(plan.target.spec_file).write_text(self.spec.model_dump_json(indent=1))
        try:
            planner = self._spawn(plan.planner)
            self._wait_ready([planner])
            self.planner_endpoint = planner.info["endpoint"]
            plan = plan.with_planner(self.planner_endpoint)
            rest = [self._spawn(c) for c in plan.components if c.role != "planner"]
            self._wait_ready(rest)
            (self.run_dir / ENDPOINTS_FILE).write_text(json.dumps(self.endpoints(), indent=1))
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

