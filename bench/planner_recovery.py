"""Planner restart at the documented defaults (issue 22 item 2): from SIGKILL to serving again.

    python bench/planner_recovery.py [--step-s 0.4] [--kill-at 170] [--after 60] [--runs 1]

One mixture (bench/chaos.py's sources and batch, 2 ranks, every `runtime` setting at its default:
journal_every 100, prefetch_s 10, max_lead_steps 32, heartbeat_s 2) runs under the embedded runtime with
a RestartPolicy at its defaults supervising on its own thread, or (`--cli`) as `mixplane run` itself. Two
trainer ranks (threads of this process, `--step-s` of training per step) consume steps; when rank 0 has
received `--kill-at` steps the planner is SIGKILLed (by default just before the planner's 2nd journal
checkpoint, so the newest journal anchor is ~100 steps old: the worst case of journal_every), the supervisor
restarts it, it recovers its session and the ranks go on for `--after` steps.

Measured per run: the planner's restart (kill -> it answers a status request), kill -> recovery complete
(every step its predecessor planned is planned again: STATUS `recovering` false and `planned_through` >=
`recover_through`), the steps re-planned (from the planner's log), and the trainers' longest wait for a
step after the kill, less one step time (`stall_s`: 0 when the look-ahead hid the restart).

The last stdout line is one JSON object: {"step_s", "journal_every", "prefetch_s", "runs": [...], ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))
# the runtime's components (child processes) run this checkout's code too, not an installed mixplane
os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])

from chaos import CACHE, ROWS, SEQ, write_sources  # noqa: E402


def spec_doc(root: Path) -> dict[str, Any]:
    return {
        "name": "planner-recovery",
        "sources": [{"name": n, "uri": str(root / n), "kind": "tokens", "columns": ["tokens"], "shuffle": "rowgroup"}
                    for n in ("a", "b", "c")],
        "mixture": {"weights": {"a": 0.5, "b": 0.3, "c": 0.2}, "seed": 11},
        "batch": {"sequences": ROWS, "seq_len": SEQ, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 2}}},
        "strategy": {"name": "vanilla"},
        "runtime": {"metrics": False},  # everything else at its documented default
    }


class Ranks:
    def __init__(self, endpoint: str, step_s: float, stop: int):
        from mixplane.client import MixtureLoader

        self.times: dict[int, list[float]] = {0: [], 1: []}
        self.errors: list[BaseException] = []

        def work(r: int) -> None:
            try:
                for _ in MixtureLoader(endpoint, rank=r, max_steps=stop):
                    self.times[r].append(time.monotonic())
                    time.sleep(step_s)
            except BaseException as e:  # noqa: BLE001 - reported
                self.errors.append(e)

        self.threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in (0, 1)]
        for t in self.threads:
            t.start()

    def join(self, timeout_s: float) -> None:
        for t in self.threads:
            t.join(timeout_s)


class Embedded:
    """The runtime in this process, supervised on its own thread (what `mixplane run` does)."""

    def __init__(self, spec: Any, run_dir: Path, standby: bool = True):
        from mixplane.runtime import EmbeddedRuntime, RestartPolicy

        self.rt = EmbeddedRuntime(spec, run_dir, restart=RestartPolicy(standby=standby), log_level="INFO").start()
        self.rt.supervise_in_background(0.2)
        self.endpoint = self.rt.planner_endpoint
        self.run_dir = self.rt.run_dir

    def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        self.rt.check()
        return self.rt.status(timeout_s=timeout_s)

    def planner_pid(self) -> int:
        return self.rt.child("planner").proc.pid

    def stop(self) -> None:
        self.rt.stop()


class Cli:
    """`mixplane run SPEC --run-dir DIR` as a user starts it (its own supervision, whatever it is)."""

    def __init__(self, spec: Any, run_dir: Path, extra: list[str]):
        import subprocess

        from mixplane.control import control_curve

        run_dir.mkdir(parents=True, exist_ok=True)
        spec_file = run_dir.parent / f"{run_dir.name}.spec.json"
        spec_file.write_text(spec.model_dump_json())
        self.run_dir = run_dir
        self.log = open(run_dir.parent / f"{run_dir.name}.cli.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "mixplane.cli", "run", str(spec_file), "--run-dir", str(run_dir),
                                      *extra], stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(HERE.parent / "src")})
        deadline = time.monotonic() + 120
        while not (run_dir / "endpoints.json").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mixplane run did not start (see {self.log.name})")
            time.sleep(0.05)
        eps = json.loads((run_dir / "endpoints.json").read_text())
        self.endpoint = eps["planner"]
        self.curve = control_curve(run_dir=run_dir)
        if eps.get("key_dir"):
            os.environ["MIXPLANE_CURVE_DIR"] = eps["key_dir"]
            os.environ["MIXPLANE_CURVE_NAME"] = "client"

    def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        from mixplane.control import status

        if self.proc.poll() is not None:
            raise SystemExit(f"mixplane run exited with {self.proc.returncode} (see {self.log.name})")
        return status(self.endpoint, timeout_s, curve=self.curve)

    def planner_pid(self) -> int:
        return int(json.loads((self.run_dir / "endpoints.json").read_text())["components"]["planner"]["pid"])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def one_run(spec: Any, work: Path, args: argparse.Namespace, i: int) -> dict[str, Any]:
    rt: Any = Cli(spec, work / f"run{i}", args.cli_args.split()) if args.cli else Embedded(spec, work / f"run{i}", not args.no_standby)
    try:
        ranks = Ranks(rt.endpoint, args.step_s, args.kill_at + args.after)
        while len(ranks.times[0]) < args.kill_at:
            if ranks.errors:
                raise ranks.errors[0]
            time.sleep(0.01)
        before = rt.status()
        t_kill = time.monotonic()
        os.kill(rt.planner_pid(), signal.SIGKILL)
        t_answer = t_done = None
        st: dict[str, Any] = {}
        while t_done is None and time.monotonic() - t_kill < 120:
            try:
                st = rt.status(timeout_s=0.3)
            except (TimeoutError, RuntimeError, OSError):
                continue
            if st.get("incarnation") == before["incarnation"]:
                continue
            t_answer = t_answer or time.monotonic()
            if not st["recovering"] and st["planned_through"] >= st["recover_through"] >= 0:
                t_done = time.monotonic()
            time.sleep(0.02)
        ranks.join(600)
        if ranks.errors:
            raise ranks.errors[0]
        log_text = (rt.run_dir / "logs" / "planner.log").read_text(errors="replace")
    finally:
        rt.stop()
    m = re.findall(r"re-planning steps (\d+)\.\.(\d+)", log_text)
    replanned = [int(m[-1][0]), int(m[-1][1])] if m else None
    if "nothing to re-plan" in log_text.rsplit("planner restarted", 1)[-1]:
        replanned = []  # the constructors held every step the killed planner had planned
    stall = 0.0
    for ts in ranks.times.values():
        gaps = [b - a for a, b in zip(ts, ts[1:]) if b > t_kill]
        stall = max(stall, max(gaps, default=0.0) - args.step_s)
    return {"kill_at_step": args.kill_at, "planned_through_at_kill": before["planned_through"],
            "restart_s": None if t_answer is None else round(t_answer - t_kill, 3),
            "recovered_s": None if t_done is None else round(t_done - t_kill, 3),
            "replanned": replanned,
            "replanned_steps": None if replanned is None else (replanned[1] - replanned[0] + 1 if replanned else 0),
            "stall_s": round(max(stall, 0.0), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-s", type=float, default=0.4, help="training time per step (s)")
    ap.add_argument("--kill-at", type=int, default=170, help="rank 0's steps received when the planner is killed")
    ap.add_argument("--after", type=int, default=60, help="steps the ranks consume after the kill")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--work", default=None)
    ap.add_argument("--cli", action="store_true", help="run the data plane as `mixplane run` (a process) instead of in here")
    ap.add_argument("--no-standby", action="store_true", help="embedded: no warm standby process (every restart "
                    "starts a new interpreter; with --cli: --cli-args --no-standby)")
    ap.add_argument("--cli-args", default="", help="extra arguments of `mixplane run` (e.g. '--restarts 3')")
    args = ap.parse_args()
    from mixplane.spec import parse_spec

    spec = parse_spec(spec_doc(write_sources(CACHE / "data")))
    work = Path(args.work) if args.work else CACHE / time.strftime("planner-recovery-%Y%m%dT%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    runs = [one_run(spec, work, args, i) for i in range(args.runs)]
    for r in runs:
        print(json.dumps(r), flush=True)
    load = os.getloadavg()
    print(json.dumps({"step_s": args.step_s, "supervision": "mixplane run " + args.cli_args if args.cli else
                      "embedded" + (" --no-standby" if args.no_standby else ""),
                      "journal_every": spec.runtime.journal_every,
                      "prefetch_s": spec.runtime.prefetch_s, "max_lead_steps": spec.runtime.max_lead_steps,
                      "runs": runs, "max_stall_s": max(r["stall_s"] for r in runs),
                      "max_recovered_s": max((r["recovered_s"] or 1e9) for r in runs),
                      "loadavg": [round(x, 2) for x in load]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
