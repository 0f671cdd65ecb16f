"""Chaos benchmark (issue 11 item 9): SIGKILL components at random times and prove nothing changed.

    python bench/chaos.py [--quick] [--steps N] [--kills K] [--roles loader,constructor,planner]

One mixture (3 token sources, 8 x 256-token rows per step) is run twice with the embedded runtime and
4 trainer ranks, each a process of its own. The trainer model: a rank takes `--compute-s` (default 0.25 s)
per step after it received the step's batch, and then waits at a barrier for every rank of its world to
finish that step — data-parallel training is synchronous (the gradient all-reduce), so a rank that waits
for data holds every rank up. 0.25 s is far shorter than a foundation model's step (seed 001 reports
13.6-16.9 s iterations) so that 2000 steps run in ~9 minutes; it makes the test harder, not easier: the
data plane recovers in seconds whatever the step, so a short step packs 24 failures into minutes and asks
the look-ahead for more steps to cover a recovery (`--independent-ranks`: no barrier).

* reference — no failure;
* chaos — the same spec, while a seeded schedule SIGKILLs components at random steps of the run (every
  role whose restart the runtime supervises: loaders — primaries and shadows when the spec has shadows —,
  constructors and the planner; `--roles` chooses), restarts one trainer rank after SIGKILL of its process
  from its last checkpoint (trainers save their state_dict every `--checkpoint-every` steps, 20: the rank
  rolls back and receives the steps after its checkpoint again), and changes DP 4 -> 2 once at a step
  boundary (live resharding: trainer ranks stop at the boundary, `EmbeddedRuntime.reshard` changes the
  running data plane, the new world's ranks resume from the state_dict). With shadows (default
  `--shadows 1`) every 8th scheduled kill from the 2nd on is a *double* kill (a loader primary and its
  shadow SIGKILLed 57 ms apart) and from the 3rd on a *zombie* (a loader primary SIGSTOPped for 3 s, then
  resumed). Both runs apply the same live mixture updates at the same steps; in the chaos run the planner
  is SIGKILLed 0.5 s after the first update's acknowledgment (role `update+planner`). The reference run
  does the same DP change and updates without failures.

The runtime runs at the documented defaults (`journal_every` 100, `prefetch_s` 10, `max_lead_steps` 32,
`heartbeat_s` 2, `failover_after_s` 1; only `window` 64 and metrics off) and is supervised as `mixplane run`
supervises: a thread, the default restart backoff and its warm standby process (the budget is unlimited;
`--no-standby`: every restart starts a new interpreter).

Every trainer rank writes, per step, the (step, rank) it received, its segments (source, key, start,
length) and a digest of its tokens, together with its state_dict (one line, so a SIGKILL never separates
the two). The runs are compared record by record:

* lost — samples (segments) of the reference that the chaos run never delivered;
* duplicated — samples the chaos run delivered more often than the reference (a (step, rank) committed
  twice by a rank that did not restart counts too);
* mismatched_steps — steps where any rank's record differs from the reference, plus steps a rolled-back
  rank received again differently (`rolled_back_steps_redelivered`: received again, identical);
* stall — per kill: the longest gap between two consecutive steps any rank received that ends after the
  kill and began within 5 s of it (ranks first drain what they prefetched), minus the reference's median
  step gap (what the failure cost the trainer); by role, max and p50; kills close together share gaps;
* ettr — effective training time ratio: the reference's training time / the chaos run's (first to last
  step any rank received; both include the DP change, neither the runtime's start-up).
  max_stall_s and p50_stall_s cover component kills; the trainer's own restart is listed by role only.

Then `mixplane replay` rebuilds `--replays` random delivered (step, rank) pairs of the chaos run from
its journal and compares their tokens with what the rank got (bit for bit).

The last stdout line: {"steps", "kills", "kills_by_role", "lost", "duplicated", "mismatched_steps",
"max_stall_s", "max_stall_s_by_role", "p50_stall_s", "ettr", "replay_checked", "replay_bit_exact", ...}.
`--quick`: ~3 minutes (120 steps, 3 kills, 10 replays). `--compute-s 0.02`: very short steps (the look-ahead
is then capped at `max_lead_steps`: 0.64 s of training; `lookahead_plus_2_s` in the JSON is the bound the
stalls are held to).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(SRC))
# the runtime's components (child processes) run this checkout's code too, not an installed mixplane
os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])

RANKS = 4
RESHARD_DP = 2
SEQ = 256
ROWS = 8
CACHE = Path(os.environ.get("MIXPLANE_BENCH_CACHE", Path.home() / ".cache" / "mixplane" / "chaos"))


# ------------------------------------------------------------------------------------------- data
def write_sources(root: Path) -> Path:
    """Three token sources (different document lengths), built once and cached."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = root / ".done"
    if done.exists():
        return root
    for name, rows, files, mean, seed in (("a", 20000, 4, 60, 1), ("b", 12000, 3, 150, 2), ("c", 6000, 2, 400, 3)):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(seed)
        lens = np.maximum(1, rng.lognormal(np.log(mean), 0.9, rows).astype(np.int64))
        docs = [rng.integers(3, 32000, n, dtype=np.int32) for n in lens]
        per = -(-rows // files)
        for f in range(files):
            part = docs[f * per:(f + 1) * per]
            t = pa.table({"tokens": pa.array(part, type=pa.list_(pa.int32())),
                          "id": pa.array(np.arange(f * per, f * per + len(part)), pa.int64())})
            pq.write_table(t, d / f"part-{f:03d}.parquet", row_group_size=500, write_page_index=True)
    done.write_text("ok")
    return root


def spec_doc(root: Path, *, shadows: int = 0) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "chaos",
        "sources": [{"name": n, "uri": str(root / n), "kind": "tokens", "columns": ["tokens"], "shuffle": "rowgroup"}
                    for n in ("a", "b", "c")],
        "mixture": {"weights": {"a": 0.5, "b": 0.3, "c": 0.2}, "seed": 11},
        "batch": {"sequences": ROWS, "seq_len": SEQ, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": RANKS}}},
        "strategy": {"name": "vanilla"},
        # the documented defaults (journal_every, prefetch_s, max_lead_steps, heartbeat_s, failover_after_s,
        # step_timeout_s): a small window and no metrics ports only
        "runtime": {"window": 64, "metrics": False},
    }
    if shadows:
        doc["runtime"]["shadow_loaders"] = shadows
    return doc


# ------------------------------------------------------------------------------------------- trainer rank
class StepBarrier:
    """The trainers' synchronous step (a thread of the benchmark): a rank reports each step it finished and
    is answered once every rank of its world finished it. A restarted rank reports from its next step on,
    which counts for the steps before it too (it finished those in its previous life)."""

    def __init__(self) -> None:
        import threading

        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.done: dict[tuple[int, int], int] = {}  # (world, rank) -> last step it finished
        self.waiting: list[tuple[bytes, int, int]] = []  # identity, world, step
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop:
            if not self.sock.poll(100):
                continue
            ident, _, body = self.sock.recv_multipart()
            m = json.loads(body)
            world, rank, step = int(m["world"]), int(m["rank"]), int(m["step"])
            self.done[(world, rank)] = max(self.done.get((world, rank), -1), step)
            self.waiting.append((ident, world, step))
            still = []
            for ident, w, s in self.waiting:
                if min(self.done.get((w, r), -1) for r in range(w)) >= s:
                    self.sock.send_multipart([ident, b"", b"ok"])
                else:
                    still.append((ident, w, s))
            self.waiting = still

    def close(self) -> None:
        self._stop = True
        self.thread.join()
        self.ctx.destroy(linger=0)


def trainer(args: argparse.Namespace) -> int:
    """One trainer rank (a process): consume steps [its state, stop), a record line per step."""
    import zmq

    from mixplane.client import MixtureLoader

    out = Path(args.out)
    ckpt = out.with_suffix(".ckpt")
    state = None
    if out.exists():  # restarted: a torn last line (killed while writing) is not committed, cut it
        text = out.read_text()
        if not text.endswith("\n"):
            text = text[:text.rfind("\n") + 1]
            out.write_text(text)
    if ckpt.exists():  # restarted: roll back to the last checkpoint (steps after it are trained again)
        state = json.loads(ckpt.read_text())
    if state is None and args.state:
        state = json.loads(Path(args.state).read_text())
    loader = MixtureLoader(args.planner, rank=args.rank, max_steps=args.stop, timeout_s=120)
    if state is not None:
        loader.load_state_dict(state)
    barrier = None
    if args.barrier:
        barrier = zmq.Context.instance().socket(zmq.REQ)
        barrier.linger = 0
        barrier.connect(args.barrier)
    with open(out, "a") as f:
        for b in loader:
            step = int(b["step"])
            segs = [list(t) for t in zip(*(b[k].tolist() for k in ("segment_source", "segment_key", "segment_start", "segment_len")))]
            digest = hashlib.blake2b(b["input_ids"].numpy().tobytes(), digest_size=12).hexdigest()
            st = loader.state_dict()
            f.write(json.dumps({"step": step, "rank": args.rank, "t": time.time(), "segs": segs, "digest": digest,
                                "state": st}) + "\n")
            f.flush()
            if (step + 1) % args.checkpoint_every == 0:  # the trainer's checkpoint (with the model's, every N steps)
                tmp = ckpt.with_suffix(".tmp")
                tmp.write_text(json.dumps(st))
                os.replace(tmp, ckpt)
            time.sleep(args.compute_s)  # the training step
            if barrier is not None:  # the all-reduce: every rank of the world finished this step
                barrier.send(json.dumps({"world": args.world, "rank": args.rank, "step": step}).encode())
                barrier.recv()
    loader.close()
    return 0


# ------------------------------------------------------------------------------------------- one run
class Run:
    def __init__(self, name: str, spec: Any, work: Path, args: argparse.Namespace, chaos: bool):
        self.name, self.spec, self.args, self.chaos = name, spec, args, chaos
        self.dir = work / name
        self.records = self.dir / "records"
        self.rng = random.Random(args.seed)
        self.kills: list[dict[str, Any]] = []
        self.trainers: dict[int, subprocess.Popen] = {}
        self.stop_step = args.steps
        self.reshard_at = args.steps // 2
        self.rt: Any = None
        self.reshard_s = 0.0
        self._tails: dict[Path, tuple[int, int]] = {}  # record file -> (bytes counted, lines counted)
        self.trainer_errors = 0
        self.stopped: dict[int, float] = {}  # SIGSTOPped pid -> when it is resumed
        # live updates: (global step reached, effective step, weights), the same in both runs; effective far
        # enough ahead that no planner has planned it yet (the look-ahead is at most max_lead_steps + 2 steps)
        n = args.steps
        self.updates: list[tuple[int, int, dict[str, float]]] = [
            (max(2, n // 20), max(2, n // 20) + 50, {"a": 0.2, "b": 0.3, "c": 0.5}),
            (n // 2 + n // 10, n // 2 + n // 10 + 50, {"a": 0.6, "b": 0.2, "c": 0.2})]
        self.updates = [u for u in self.updates if u[1] < n and not (u[0] <= n // 2 <= u[1] + 2)]
        self.update_log: list[dict[str, Any]] = []

    def spawn(self, rank: int, stop: int, state: Path | None = None, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--role", "trainer", "--planner", self.rt.planner_endpoint,
               "--rank", str(rank), "--stop", str(stop), "--out", str(self.records / f"rank{rank}-w{self.world}.jsonl"),
               "--compute-s", str(self.args.compute_s), "--world", str(self.world),
               "--checkpoint-every", str(self.args.checkpoint_every)]
        if self.barrier is not None:
            cmd += ["--barrier", self.barrier.endpoint]
        if state is not None:
            cmd += ["--state", str(state)]
        e = {**os.environ, "PYTHONPATH": str(SRC), **(env or {})}
        log = open(self.dir / f"trainer-{rank}-w{self.world}.log", "ab")
        self.trainers[rank] = subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    # -- events beyond a single SIGKILL (issue 22): a primary and its shadow killed 57 ms apart, a SIGSTOPped
    # ("zombie") loader resumed 3 s later, a live mixture update followed by a planner SIGKILL 0.5 s after its
    # acknowledgment (the update itself happens in both runs, at the same step)
    def event(self, at: int) -> bool:
        idx = len([k for k in self.kills if k["role"] not in ("trainer", "update+planner", "shadow-of-double")])
        kind = "kill"
        if self.args.shadows and idx % 8 == 1:
            kind = "double"
        elif self.args.shadows and idx % 8 == 2:
            kind = "zombie"
        if kind == "kill":
            vs = self.victims()
            if not vs:
                return False
            role, c = self.rng.choice(vs)
            os.kill(c.proc.pid, signal.SIGKILL)
            self.kills.append({"role": role, "name": c.name, "t": time.time(), "step": at})
            return True
        try:
            parts = self.rt.partitions()["partitions"]
        except Exception:  # noqa: BLE001 - the planner is restarting: another time
            return False
        served = sorted({(p["host"], p["shadows"][0] if p["shadows"] else None) for p in parts.values()},
                        key=lambda x: (x[0] or "", x[1] or ""))
        served = [x for x in served if x[0] and (kind == "zombie" or x[1])]
        if not served:
            return False
        host, shadow = self.rng.choice(served)
        prim = next((c for c in self.rt.children if c.name == host and c.proc.poll() is None), None)
        if prim is None:
            return False
        if kind == "zombie":
            os.kill(prim.proc.pid, signal.SIGSTOP)
            self.stopped[prim.proc.pid] = time.monotonic() + 3.0
            self.kills.append({"role": "zombie", "name": host, "t": time.time(), "step": at})
            return True
        sh = next((c for c in self.rt.children if c.name == shadow and c.proc.poll() is None), None)
        os.kill(prim.proc.pid, signal.SIGKILL)
        t = time.time()
        time.sleep(0.057)
        if sh is not None:
            os.kill(sh.proc.pid, signal.SIGKILL)
        self.kills.append({"role": "double", "name": f"{host}+{shadow}", "t": t, "step": at})
        return True

    def resume_stopped(self) -> None:
        now = time.monotonic()
        for pid, until in list(self.stopped.items()):
            if now >= until:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                del self.stopped[pid]

    def updates_due(self) -> None:
        """The run's live mixture updates (both runs, at the same global steps and effective steps); in the chaos
        run the planner is SIGKILLed 0.5 s after the first one was acknowledged."""
        from mixplane import control

        while self.updates and self.progress() >= self.updates[0][0]:
            at, eff, weights = self.updates.pop(0)
            t_end = time.monotonic() + 60
            while True:
                try:
                    ack = control.update_mixture(self.rt.planner_endpoint, {"weights": weights, "effective_step": eff},
                                                 timeout_s=30, curve=self.rt.control_curve)
                    break
                except (RuntimeError, TimeoutError) as e:  # a planner restarting or recovering: ask again
                    if time.monotonic() > t_end or "rejected" in str(e):
                        raise
                    time.sleep(0.2)
            self.update_log.append({"at": at, "effective_step": eff, "generation": ack.get("generation")})
            if self.chaos and len(self.update_log) == 1:
                time.sleep(0.5)
                planner = next(c for c in self.rt.children if c.name == "planner")
                os.kill(planner.proc.pid, signal.SIGKILL)
                self.kills.append({"role": "update+planner", "name": "planner", "t": time.time(), "step": at})

    def victims(self) -> list[tuple[str, Any]]:
        """Live components of the roles that may be killed; a loader process is a "shadow" when it is the
        primary of no partition in the planner's table (a promoted shadow is a primary, its restarted old
        primary a shadow)."""
        roles = set(self.args.roles.split(","))
        primaries: set[str] | None = None
        if self.args.shadows:
            try:
                primaries = {p["host"] for p in self.rt.partitions()["partitions"].values()}
            except Exception:  # noqa: BLE001 - the planner is restarting: kill another time
                return []
        out = []
        for c in self.rt.children:
            if c.component is None or c.proc.poll() is not None:
                continue
            role = c.component.role
            if role == "loader" and primaries is not None and c.name not in primaries:
                role = "shadow"
            if role in roles:
                out.append((role, c))
        return out

    def committed(self, rank: int) -> int:
        """Steps this rank committed in the current world (the new bytes of its record file are counted)."""
        p = self.records / f"rank{rank}-w{self.world}.jsonl"
        off, n = self._tails.get(p, (0, 0))
        if p.exists():
            with open(p, "rb") as f:
                f.seek(off)
                new = f.read()
            end = new.rfind(b"\n")  # a line without its newline is not committed yet
            if end >= 0:
                n += new[:end + 1].count(b"\n")
                off += end + 1
            self._tails[p] = (off, n)
        return n

    def progress(self) -> int:
        """The global step the run reached (rank 0's steps committed, counted over both worlds)."""
        return self.committed(0) + (self.reshard_at if self.world != RANKS else 0)

    def run(self) -> float:
        from mixplane.runtime import EmbeddedRuntime, RestartPolicy

        self.records.mkdir(parents=True, exist_ok=True)
        # supervision as `mixplane run` does it: its default backoff, on a thread of its own (the budget is
        # unlimited: the run kills far more often than the default 3 restarts per 5 minutes)
        policy = RestartPolicy(budget=10_000, roles=tuple(r for r in ("loader", "constructor", "planner")
                                                          if r in self.args.supervised), standby=not self.args.no_standby)
        self.rt = EmbeddedRuntime(self.spec, self.dir / "run", restart=policy, log_level="WARNING").start()
        self.rt.supervise_in_background(0.2)
        self.barrier = None if self.args.independent_ranks else StepBarrier()
        self.barrier_used = self.barrier is not None
        try:
            t0 = time.monotonic()
            self.world = RANKS
            for r in range(RANKS):
                self.spawn(r, self.reshard_at)
            plan = self.kill_plan() if self.chaos else []
            trainer_kill = self.args.trainer_restart and self.chaos
            self.phase(plan, trainer_kill, self.reshard_at)
            # live DP change at the boundary: every rank stopped there; the new world resumes from rank 0's state
            last = json.loads((self.records / f"rank0-w{self.world}.jsonl").read_text().splitlines()[-1])
            state_file = self.dir / "reshard-state.json"
            state_file.write_text(json.dumps(last["state"]))
            deadline = time.monotonic() + 120
            while self.restarting() and time.monotonic() < deadline:  # a component restart still under way
                self.rt.check()
                time.sleep(0.05)
            t_r = time.monotonic()
            self.rt.reshard({"modules": {"backbone": {"dp": RESHARD_DP}}}, last["state"], attempt=f"{self.name}-reshard")
            self.reshard_s = time.monotonic() - t_r
            self.world = RESHARD_DP
            for r in range(RESHARD_DP):
                self.spawn(r, self.stop_step, state_file, env={"MIXPLANE_RESUME_ID": f"{self.name}-reshard"})
            self.phase(plan, False, self.stop_step)
            return time.monotonic() - t0
        finally:
            for p in self.trainers.values():
                if p.poll() is None:
                    p.kill()
            if self.barrier is not None:
                self.barrier.close()
            self.rt.stop()

    def kill_plan(self) -> list[int]:
        """The steps of the run at which a component is killed: uniform over the training (so every kill
        lands while ranks are consuming), none right at the DP change."""
        steps = [s for s in range(5, self.stop_step - 5) if abs(s - self.reshard_at) > 3]
        return sorted(self.rng.choice(steps) for _ in range(self.args.kills))

    def phase(self, plan: list[float], trainer_kill: bool, stop: int) -> None:
        """Until every trainer of this world finished: kill on schedule, supervise, restart a trainer once."""
        deadline = time.monotonic() + self.args.timeout_s
        tk_at = self.rng.randint(stop // 4, max(stop // 4 + 1, stop // 2)) if trainer_kill else None
        while [p.poll() for p in self.trainers.values()].count(None):  # every rank polled: a failed one is seen
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: trainers did not finish within {self.args.timeout_s:g}s")
            for r, p in self.trainers.items():
                if p.returncode not in (None, 0, -signal.SIGKILL):
                    self.trainer_errors += 1
                    raise RuntimeError(f"{self.name}: trainer rank {r} exited with {p.returncode} "
                                       f"(see {self.dir}/trainer-{r}-w{self.world}.log)")
            self.rt.check()
            self.updates_due()
            if plan and self.progress() >= plan[0] and not self.restarting() and not self.stopped:
                if self.event(plan[0]):  # none while the planner restarts: try again on the next round
                    plan.pop(0)
            self.resume_stopped()
            if tk_at is not None and self.committed(1) >= tk_at:
                p = self.trainers[1]
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
                self.kills.append({"role": "trainer", "name": "rank1", "t": time.time()})
                self.spawn(1, stop)  # continues from the state_dict in its last record
                tk_at = None
            time.sleep(0.05)
        bad = {r: p.returncode for r, p in self.trainers.items() if p.returncode != 0}
        if bad:
            raise RuntimeError(f"{self.name}: trainers failed: {bad}")

    def restarting(self) -> bool:
        return any(c.proc.poll() is not None for c in self.rt.children)  # dead, not yet restarted


# ------------------------------------------------------------------------------------------- compare
def load(run: Run) -> tuple[dict[tuple[int, int, int], dict], int, int, int]:
    """(world, step, rank) -> record (the first one committed); (step, rank)s committed again by a rank that rolled
    back to its checkpoint (identical: expected), committed again differently (a mismatch), and committed again by
    a rank that did not restart (a duplicate)."""
    out: dict[tuple[int, int, int], dict] = {}
    again = differ = twice = 0
    restarted = {k["name"] for k in run.kills if k["role"] == "trainer"}
    for f in sorted(run.records.glob("rank*-w*.jsonl")):
        world = int(f.stem.split("-w")[1])
        for ln in f.read_text().splitlines():
            try:
                rec = json.loads(ln)
            except ValueError:
                continue
            key = (world, rec["step"], rec["rank"])
            if key not in out:
                out[key] = rec
            elif f"rank{rec['rank']}" not in restarted:
                twice += 1
            elif (out[key]["segs"], out[key]["digest"]) == (rec["segs"], rec["digest"]):
                again += 1
            else:
                differ += 1
    return out, again, differ, twice


def stalls(run: Run, ref_gap: float, horizon_s: float = 12.0) -> list[dict[str, Any]]:
    """Per kill: the longest gap between consecutive steps of any rank that ends after the kill and began
    before kill + horizon_s (ranks first drain what was prefetched, so the stall may start after the kill),
    minus the reference's median gap. The gaps of a restarted trainer rank around its own restart count
    for that restart only — with synchronous ranks every rank's gap around it (they all wait for it)."""
    times: dict[tuple[int, int], list[float]] = {}
    recs = load(run)[0]
    for (w, _step, rank), rec in recs.items():
        times.setdefault((rank, w), []).append(rec["t"])
    for v in times.values():
        v.sort()
    restarts = [k for k in run.kills if k["role"] == "trainer"]
    out = []
    for k in run.kills:
        worst = 0.0
        for (rank, _w), ts in times.items():
            own = restarts if run.barrier_used else [r for r in restarts if r["name"] == f"rank{rank}"]
            for a, b in zip(ts, ts[1:]):
                if not (b > k["t"] and a < k["t"] + horizon_s):
                    continue
                in_restart = any(a <= r["t"] < b for r in own)
                if (k["role"] == "trainer") != in_restart:
                    continue
                worst = max(worst, b - a)
        out.append({**k, "stall_s": max(0.0, worst - ref_gap)})
    return out


def replay_check(run: Run, recs: dict, n: int, seed: int) -> tuple[int, int, list[str]]:
    import numpy as np

    from mixplane.replay import replay_step

    rng = random.Random(seed)
    keys = rng.sample(sorted(recs), min(n, len(recs)))
    ok, bad = 0, []
    tmp = run.dir / "replay.npz"
    for world, step, rank in keys:
        try:
            out = replay_step(run.spec, step=step, rank=rank, run_dir=str(run.dir / "run"), save=str(tmp))
            ids = np.load(tmp)["input_ids"]
            digest = hashlib.blake2b(np.ascontiguousarray(ids).tobytes(), digest_size=12).hexdigest()
            segs = [[s["source"], s["key"], s["start"], s["len"]] for s in out["segments"]]
            names = run.spec.source_names()
            rsegs = [[names[a], b, c, d] for a, b, c, d in recs[(world, step, rank)]["segs"]]
            if digest == recs[(world, step, rank)]["digest"] and segs == rsegs and out["digest_match"]:
                ok += 1
            else:
                bad.append(f"step {step} rank {rank}")
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            bad.append(f"step {step} rank {rank}: {e}")
    return len(keys), ok, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="about 3 minutes: 120 steps, 3 kills (a double kill and a zombie "
                    "among them), an update + planner kill, a trainer rollback")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--kills", type=int, default=24, help="component kills scheduled (the trainer restart is extra)")
    ap.add_argument("--roles", default="loader,shadow,constructor,planner", help="roles that may be killed")
    ap.add_argument("--supervised", default="loader,constructor,planner", help="roles the runtime restarts (comma list)")
    ap.add_argument("--no-standby", action="store_true", help="no warm standby process (mixplane run --no-standby): "
                    "every restart starts a new interpreter")
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--compute-s", type=float, default=0.25, help="simulated training time per step (s)")
    ap.add_argument("--independent-ranks", action="store_true",
                    help="no step barrier: each rank consumes at its own pace (not how data-parallel training runs)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--shadows", type=int, default=1, help="runtime.shadow_loaders of the spec (the double kill and "
                    "the zombie need 1)")
    ap.add_argument("--checkpoint-every", type=int, default=20,
                    help="trainers save their state_dict every N steps; a restarted rank rolls back to it")
    ap.add_argument("--no-trainer-restart", dest="trainer_restart", action="store_false")
    ap.add_argument("--timeout-s", type=float, default=7200.0)
    ap.add_argument("--work", default=None, help="work directory (default: a fresh one under the cache)")
    # trainer subprocess
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--planner", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--stop", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--state", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--barrier", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "trainer":
        return trainer(args)
    if args.quick:
        args.steps, args.kills, args.replays = min(args.steps, 120), min(args.kills, 3), min(args.replays, 10)
    # only roles the runtime restarts can be killed without failing the run
    args.roles = ",".join(r for r in args.roles.split(",")
                          if r in args.supervised.split(",") or (r == "shadow" and "loader" in args.supervised))

    from mixplane.spec import parse_spec

    work = Path(args.work) if args.work else CACHE / time.strftime("run-%Y%m%dT%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    spec = parse_spec(spec_doc(write_sources(CACHE / "data"), shadows=args.shadows))
    args.supervised = args.supervised.split(",")

    ref = Run("reference", spec, work, args, chaos=False)
    ref_wall = ref.run()
    chaos = Run("chaos", spec, work, args, chaos=True)
    chaos_wall = chaos.run()
    (chaos.dir / "kills.json").write_text(json.dumps(chaos.kills))  # the stall analysis can be redone offline

    want = load(ref)[0]
    got, rolled_back, redelivered_differently, twice = load(chaos)
    # training time: first to last step any rank received (the runtimes' start-up is not training time)
    ref_wall = max(r["t"] for r in want.values()) - min(r["t"] for r in want.values())
    chaos_wall = max(r["t"] for r in got.values()) - min(r["t"] for r in got.values())
    mismatched = sorted({k[1] for k in set(want) | set(got)
                         if k not in want or k not in got or (want[k]["segs"], want[k]["digest"]) != (got[k]["segs"], got[k]["digest"])})
    mismatched_n = len(mismatched) + redelivered_differently
    wc = Counter(tuple(s) for r in want.values() for s in r["segs"])
    gc = Counter(tuple(s) for r in got.values() for s in r["segs"])
    lost = sum((wc - gc).values())
    duplicated = sum((gc - wc).values()) + twice
    gaps = []
    for rank in range(RANKS):
        ts = sorted(r["t"] for k, r in want.items() if k[2] == rank)
        gaps += [b - a for a, b in zip(ts, ts[1:])]
    ref_gap = statistics.median(gaps) if gaps else 0.0
    st = stalls(chaos, ref_gap)
    by_role: dict[str, list[float]] = {}
    for s in st:
        by_role.setdefault(s["role"], []).append(s["stall_s"])
    checked, ok, bad = replay_check(chaos, got, args.replays, args.seed)
    for b in bad[:5]:
        print(f"replay mismatch: {b}", file=sys.stderr)
    all_st = [s["stall_s"] for s in st if s["role"] != "trainer"]  # a trainer's own restart is not the data plane's stall
    print(json.dumps({"kills_detail": [{k: v for k, v in s.items() if k != "t"} for s in st]}))
    print(json.dumps({
        "steps": args.steps, "kills": len(chaos.kills), "kills_by_role": dict(Counter(k["role"] for k in chaos.kills)),
        "lost": lost, "duplicated": duplicated, "mismatched_steps": mismatched_n,
        "rolled_back_steps_redelivered": rolled_back, "trainer_errors": chaos.trainer_errors + ref.trainer_errors,
        "updates": chaos.update_log,
        "max_stall_s": round(max(all_st, default=0.0), 3),
        "max_stall_s_by_role": {r: round(max(v), 3) for r, v in by_role.items()},
        "p50_stall_s": round(statistics.median(all_st), 3) if all_st else 0.0,
        "ettr": round(ref_wall / chaos_wall, 4),
        "replay_checked": checked, "replay_bit_exact": ok,
        "reference_wall_s": round(ref_wall, 2), "chaos_wall_s": round(chaos_wall, 2),
        "reshard_s": [round(ref.reshard_s, 2), round(chaos.reshard_s, 2)],
        "ranks": RANKS, "dp_change": [RANKS, RESHARD_DP, chaos.reshard_at], "compute_s": args.compute_s,
        "supervised": args.supervised, "standby": not args.no_standby, "shadows": args.shadows, "synchronous_ranks": not args.independent_ranks,
        "prefetch_s": spec.runtime.prefetch_s, "journal_every": spec.runtime.journal_every,
        "heartbeat_s": spec.runtime.heartbeat_s, "checkpoint_every": args.checkpoint_every,
        "lookahead_plus_2_s": round(min(spec.runtime.prefetch_s, spec.runtime.max_lead_steps * args.compute_s) + 2, 3),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
