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
- ``rank-<r>.exited``: written at interpreter exit for a rank whose loader was never closed, when no exception went
  unhandled and no close saw one (a framework's trainer that just returns, e.g. the Hugging Face Trainer's
  ``train()``). It cannot tell ``sys.exit(1)`` after an unclosed loader from a success, so it counts less than
  ``done``: under ``restartPolicy: Never`` (where the trainer container's own exit status decides the pod) it counts
  as done; under ``OnFailure`` / ``Always`` only once no rank of the pod has run again for `gone_s` (the kubelet
  restarts a failed container well within it: 10 s after a first failure).

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

import atexit
import enum
import errno
import fcntl
import json
import os
import sys
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
_unclosed: dict[str, int] = {}  # lock path -> rank: running, never closed (the at-exit mark's candidates)
_failed: set[str] = set()  # lock paths whose loader saw an exception on its way out (no at-exit mark)
_atexit_registered = False


def lock_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.lock")


def done_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.done")


def exited_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.exited")


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
    for mark in (done_path(directory, rank), exited_path(directory, rank)):
        try:
            os.unlink(mark)
        except FileNotFoundError:
            pass
    _unclosed[path] = rank
    _failed.discard(path)
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_at_exit)
        _atexit_registered = True


def mark_failed(directory: str, rank: int) -> None:
    """`rank`'s loader was closed with an exception on the way: no mark, now or at exit."""
    path = lock_path(directory, rank)
    _unclosed.pop(path, None)
    _failed.add(path)


def _at_exit() -> None:
    """The interpreter is exiting: a rank whose loader was never closed gets the weaker `exited` mark, unless an
    exception went unhandled (the interpreter then set sys.last_value before running this)."""
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        return
    for path, rank in list(_unclosed.items()):
        if path not in _failed:
            try:
                _write_mark(exited_path(os.path.dirname(path), rank), rank)
            except OSError:
                pass


def mark_done(directory: str, rank: int) -> None:
    """`rank` ended cleanly (its loader closed with no exception on the way)."""
    _unclosed.pop(lock_path(directory, rank), None)
    _write_mark(done_path(directory, rank), rank)


def _write_mark(path: str, rank: int) -> None:
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
    EXITED = "exited"  # its process exited normally without closing its loader (the at-exit mark), none holds the lock
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
    if os.path.exists(done_path(directory, rank)):
        return RankState.DONE
    return RankState.EXITED if os.path.exists(exited_path(directory, rank)) else RankState.ENDED


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
        running = any(s is RankState.RUNNING for s in states.values())
        if running or not self.started:
            self._gone_since = None
        elif self._gone_since is None:
            self._gone_since = now
        gone_for = 0.0 if self._gone_since is None else now - self._gone_since
        ends = [states.get(r) for r in self.ranks]
        if all(s in (RankState.DONE, RankState.EXITED) for s in ends):
            # an `exited` rank (never closed) counts once a restart in this pod would have come (or there is none)
            if RankState.EXITED in ends and self.restart_policy != "Never" and gone_for < self.gone_s:
                return None
            if quiet_for >= self.quiet_s:
                how = "ended cleanly" if RankState.EXITED not in ends else "ended (exited without closing their loader)"
                return Decision(0, f"trainer ranks {_ranks_text(self.ranks)} of this pod {how}; "
                                   f"nothing left to send for {quiet_for:.1f} s")
            return None
        if self.restart_policy != "Never" or self._gone_since is None or gone_for < self.gone_s:
            return None
        bad = {r: states.get(r, RankState.WAITING).value for r in self.ranks if states.get(r) is not RankState.DONE}
        return Decision(EXIT_TRAINER_FAILED,
                        f"no trainer rank of this pod has run for {gone_for:.0f} s and not all ended "
                        f"cleanly ({', '.join(f'rank {r} {v}' for r, v in bad.items())}; restartPolicy Never: nothing "
                        f"restarts them in this pod)")

    def poll(self, directory: str, now: float, quiet_for: float) -> Decision | None:
        return self.update({r: rank_state(directory, r) for r in self.ranks}, now, quiet_for)
