"""How a trainer pod ends under sidecar placement: its trainer ranks mark a shared directory, and the loader containers
injected beside them end when every rank of the pod ended cleanly, so the pod succeeds and its Job completes.

Kubernetes before 1.28 has no sidecar containers that stop with the main one: a loader container would run on after
the trainer exits, the pod would stay Running and its Job incomplete. The pod webhook therefore adds an emptyDir
(`VOLUME`, mounted at `MOUNT` in the trainer and loader containers; `MIXPLANE_POD_DIR` tells the client) and
gives each loader container the pod's trainer ranks and restart policy. In that directory, per global rank r:

- ``rank-<r>.lock``: created by the rank's `MixtureLoader` and held with an exclusive ``flock`` for the rest of
  its process's life. The kernel releases it when the process ends, however it ends (exit, exception, SIGKILL,
  OOM kill), so a free lock means "no process of this rank runs", without a heartbeat to tune or a PID to share
  across containers.
- ``rank-<r>.done``: written by ``MixtureLoader.close()`` (or leaving its ``with`` block) when no exception is on
  the way (an exception being raised or handled, a non-zero ``SystemExit``: not clean); removed when the rank
  starts again.

A loader container reads them (`rank_state`) and `PodEndWatch` decides: every rank of the pod done (its mark
written and its process gone) -> exit 0 once the loader has nothing left to send and no plan came for a moment
(`quiet_s`: the other pods' trainers get their last steps); a rank that ended without the mark is a crash: under
``restartPolicy: OnFailure`` / ``Always`` the kubelet starts the trainer container again in the same pod, and the
loader serves on (the restarted rank finds it, takes its lock again); under ``Never`` nothing will come back, so
once no rank of the pod has run for `gone_s` the loader exits non-zero and the pod fails (the Job's backoffLimit
decides what follows) instead of running forever. Before any rank started the loader waits, however long the
trainer takes to start.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MOUNT = "/var/run/mixplane/pod"  # where the pod webhook mounts the shared directory in every container
VOLUME = "mixplane-pod"
ENV = "MIXPLANE_POD_DIR"
QUIET_S = 5.0  # after the pod's ranks ended cleanly: no plan for this long and nothing to send -> the loader exits
GONE_S = 30.0  # restartPolicy Never: no rank of the pod running, not all done, this long -> the loader fails
EXIT_TRAINER_FAILED = 3  # the loader's exit status when the pod's trainer ended without its clean-end mark

_held: dict[str, int] = {}  # lock files this process holds (until it exits)


def lock_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.lock")


def done_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.done")


def parse_ranks(text: str) -> list[int]:
    """`A-B` (or `A`) -> [A..B]; a bad range is an error naming it."""
    lo, _, hi = text.strip().partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--trainer-ranks {text!r}: expected FIRST-LAST (e.g. 0-7)") from None
    if a < 0 or b < a:
        raise ValueError(f"--trainer-ranks {text!r}: expected 0 <= FIRST <= LAST")
    return list(range(a, b + 1))


def mark_running(directory: str, rank: int) -> None:
    """This process runs `rank`: take the rank's lock for the rest of the process's life and clear an earlier run's
    done mark. The lock is opened readable by every uid (the loader containers run as another user)."""
    path = lock_path(directory, rank)
    if path not in _held:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.fchmod(fd, 0o644)
        except OSError:
            pass  # another uid's file: readable already, or the loader says it cannot read it
        deadline = time.monotonic() + 10.0
        while True:  # a loader probing the lock holds it shared for a moment only
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() > deadline:
                    os.close(fd)
                    raise OSError(e.errno, f"{path}: cannot lock it for rank {rank} (another process of this rank "
                                           f"runs in the pod?): {e.strerror}") from None
                time.sleep(0.05)
        _held[path] = fd
    try:
        os.unlink(done_path(directory, rank))
    except FileNotFoundError:
        pass


def mark_done(directory: str, rank: int) -> None:
    """`rank` ended cleanly (its loader closed with no exception on the way)."""
    path = done_path(directory, rank)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({"rank": rank, "pid": os.getpid(), "t": time.time()}) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def ending_cleanly(exc: BaseException | None) -> bool:
    """Whether a close with `exc` on the way (raised or being handled; None: none) is a clean end: no exception,
    the end of an iteration, or `sys.exit(0)`."""
    if exc is None or isinstance(exc, StopIteration):
        return True
    if isinstance(exc, SystemExit):
        return exc.code in (None, 0)
    return False


class RankState(enum.Enum):
    WAITING = "waiting"  # no process of the rank has started yet
    RUNNING = "running"  # a process holds the rank's lock
    DONE = "done"  # ended cleanly: the done mark, and no process holds the lock
    ENDED = "ended"  # no process holds the lock and there is no done mark: it crashed or was killed


def rank_state(directory: str, rank: int) -> RankState:
    try:
        fd = os.open(lock_path(directory, rank), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return RankState.WAITING
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return RankState.RUNNING
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    return RankState.DONE if os.path.exists(done_path(directory, rank)) else RankState.ENDED


@dataclass(frozen=True)
class Decision:
    code: int  # the loader's exit status
    reason: str


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


class PodEndWatch:
    """The loader container's decision from its pod's rank states (pure: states and clocks in, a Decision or None out)."""

    def __init__(self, ranks: Sequence[int], restart_policy: str = "Always", *, quiet_s: float = QUIET_S,
                 gone_s: float = GONE_S):
        if not ranks:
            raise ValueError("a pod end watch needs the pod's trainer ranks")
        if restart_policy not in ("Always", "OnFailure", "Never"):
            raise ValueError(f"--trainer-restart {restart_policy!r}: expected Always, OnFailure or Never")
        self.ranks = list(ranks)
        self.restart_policy = restart_policy
        self.quiet_s = quiet_s
        self.gone_s = gone_s
        self.started = False
        self.crashes: dict[int, int] = {}  # rank -> ends without the mark seen (restarted in place since)
        self._last: dict[int, RankState] = {}
        self._gone_since: float | None = None

    def update(self, states: Mapping[int, RankState], now: float, quiet_for: float) -> Decision | None:
        """`states`: every rank's state now; `quiet_for`: seconds the loader has had nothing to send and no plan."""
        for r, s in states.items():
            if s is RankState.ENDED and self._last.get(r) is not RankState.ENDED:
                self.crashes[r] = self.crashes.get(r, 0) + 1
            self._last[r] = s
        if any(s is not RankState.WAITING for s in states.values()):
            self.started = True
        if all(states.get(r) is RankState.DONE for r in self.ranks):
            if quiet_for >= self.quiet_s:
                return Decision(0, f"trainer ranks {_ranks_text(self.ranks)} of this pod ended cleanly; "
                                   f"nothing left to send for {quiet_for:.1f} s")
            return None
        running = any(s is RankState.RUNNING for s in states.values())
        if self.restart_policy != "Never" or not self.started or running:
            self._gone_since = None
            return None
        if self._gone_since is None:
            self._gone_since = now
        if now - self._gone_since < self.gone_s:
            return None
        bad = {r: states.get(r, RankState.WAITING).value for r in self.ranks if states.get(r) is not RankState.DONE}
        return Decision(EXIT_TRAINER_FAILED,
                        f"no trainer rank of this pod has run for {now - self._gone_since:.0f} s and not all ended "
                        f"cleanly ({', '.join(f'rank {r} {v}' for r, v in bad.items())}; restartPolicy Never: nothing "
                        f"restarts them in this pod)")

    def poll(self, directory: str, now: float, quiet_for: float) -> Decision | None:
        return self.update({r: rank_state(directory, r) for r in self.ranks}, now, quiet_for)
