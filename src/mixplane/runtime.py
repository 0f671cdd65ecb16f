"""The embedded runtime: the launch plan of one mixture as supervised local processes.

`mixplane.launch` decides which components run with which arguments (the operator renders the same
plan into pods); this module only starts them as children of this process, waits for their ready
files, notices when one dies and stops them all. Children die with this process (PR_SET_PDEATHSIG, armed
from a thread that lives as long as the process: `_Spawner`) and stop on SIGTERM/SIGINT. Requests to the
running planner live in `mixplane.control`.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mixplane.errors import MixplaneError
from mixplane import control, settings, wire
from mixplane.control import (
    ADMIN_ROLE,
    ENDPOINTS_FILE,
    KEYS_SUBDIR,
    ControlCurve,
    default_run_dir,
    read_ready,
    request,
)
from mixplane.launch import Component, LaunchPlan, LaunchTarget, launch_plan, shadow_name
from mixplane.loader.iceberg import pin_sources
from mixplane.loader.transforms import resolve_decode_places
from mixplane.planner import journal
from mixplane.protocol import EXIT_LISTING
from mixplane.spec import DataMixtureSpec
from mixplane.wire import Kind

log = logging.getLogger("mixplane.runtime")
READY_TIMEOUT_S = 120.0
RESTART_WAIT_S = 0.5  # supervise() waits this long for the components it restarted (a standby's take-over)
KEY_ROLES = ("server", "component", "client", "admin")
MAX_RANK_KEYS = 4096  # embedded runs generate one client key per trainer rank up to this world size  # binding sockets present `server`; peers their role's pair
CLIENT_ENV = ("MIXPLANE_CURVE_DIR", "MIXPLANE_CURVE_NAME")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class _Spawner:
    """Starts the children from one daemon thread that lives as long as this process.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process: a child started from a
    thread that then ends (a caller's helper thread asking `repartition` or `add_loader_host`, the background
    supervisor once it gives up) got SIGTERM at once -- a loader host started for a re-partition exited 0 right
    after the planner handed it its partition, and that step waited for the partition forever."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Future[subprocess.Popen], list[str], dict[str, Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def popen(self, cmd: list[str], **kwargs: Any) -> subprocess.Popen:
        """subprocess.Popen(cmd, **kwargs) with the parent-death signal armed, from the spawner thread."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive() or self._pid != os.getpid():  # first, or forked
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._run, args=(self._jobs,), name="mixplane-spawner",
                                                daemon=True)
                self._pid = os.getpid()
                self._thread.start()
            fut: Future[subprocess.Popen] = Future()
            self._jobs.put((fut, cmd, kwargs))
        return fut.result()

    @staticmethod
    def _run(jobs: queue.SimpleQueue[tuple[Future[subprocess.Popen], list[str], dict[str, Any]]]) -> None:
        while True:
            fut, cmd, kwargs = jobs.get()
            try:
                fut.set_result(subprocess.Popen(cmd, preexec_fn=_die_with_parent, **kwargs))
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                fut.set_exception(e)


_SPAWNER = _Spawner()


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    ready_file: Path
    info: dict[str, Any] = field(default_factory=dict)
    component: Component | None = None
    restarts: list[float] = field(default_factory=list)  # monotonic times of its restarts
    restart_at: float | None = None  # when a restart of this dead child is due
    started: float = field(default_factory=time.monotonic)
    ready_at: float | None = None  # when its ready file appeared (how long it ran healthy counts from there)
    starting: bool = False  # a restarted incarnation whose ready file has not appeared yet (supervise() looks)
    exit_codes: list[int] = field(default_factory=list)  # of its earlier incarnations, oldest first


def last_error(log_file: Path, *, tail_bytes: int = 1 << 16) -> str | None:
    """The text of the last ERROR line of a component's log (None: none, or no log)."""
    try:
        with open(log_file, "rb") as f:
            f.seek(max(0, os.path.getsize(log_file) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    errs = [ln for ln in lines if " ERROR " in ln or ln.startswith("ERROR")]
    return errs[-1].strip() if errs else None


class ComponentFailed(MixplaneError, RuntimeError):
    """A component died and is not (or no longer) restarted; names it, its exit code and its log."""


@dataclass(frozen=True)
class RestartPolicy:
    """Restart a component of an allowed role that died: after `backoff_s`, doubling per recent restart up
    to `backoff_max_s`, at most `budget` times within `window_s`; then the run fails (ComponentFailed).

    Off by default (`mixplane run --restarts N` turns it on) and then covers every role: a restarted
    loader re-registers and the planner resends what it had planned for it (planner/inflight.py); a
    restarted planner recovers from its journal; a restarted constructor gets its layouts from the planner
    and its spans from the loaders again. Every restarted component binds the endpoints of its first
    incarnation, so its peers simply reconnect.

    An incarnation that ran `stable_s` after it was ready and then died is restarted at once (no backoff: it
    is no crash loop, and every second of a planner restart is a stall of the trainers); the backoff is for
    components dying sooner. With `standby` the runtime keeps `standbys` warm standby processes
    (mixplane.standby: interpreter started, every component's modules imported, the planner's compiled loops
    loaded); the next component to die is handed to one instead of a new interpreter (a loader only when a
    prepared one stays), and another standby is started `standby_after_s` later."""

    budget: int = 3
    window_s: float = 300.0
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    stable_s: float = 5.0
    standby: bool = True
    standbys: int = 2
    standby_after_s: float = 0.5
    roles: tuple[str, ...] = ("planner", "constructor", "loader")
    # a component silent this long (planner STATUS `silent`; the planner itself: no answer to STATUS) is hung:
    # it is killed (SIGKILL) and restarted like a dead one. None: hangs are reported, not acted on
    hang_after_s: float | None = None

    def delay(self, history: list[float], now: float, ran_s: float | None = None) -> float | None:
        """Seconds to wait before the next restart, or None when the budget within the window is spent.
        `ran_s`: how long the incarnation that died ran after it was ready (None: it never was); at least
        `stable_s` restarts it at once."""
        recent = [t for t in history if now - t < self.window_s]
        if len(recent) >= self.budget:
            return None
        if ran_s is not None and ran_s >= self.stable_s:
            return 0.0
        return min(self.backoff_max_s, self.backoff_s * (2 ** len(recent)))


def pinned(comp: Component, info: dict[str, Any]) -> Component:
    """`comp` as it must be started again: on the endpoints its first incarnation announced (`info`, its
    ready file), so that peers reconnect to the same address instead of having to learn a new one."""
    args = list(comp.args)
    if comp.role == "planner" and info.get("endpoint"):
        i = args.index("--bind")
        args[i + 1] = str(info["endpoint"])
    elif comp.role == "constructor" and info.get("data_endpoint") and info.get("client_endpoint"):
        ports = {"--data-port": str(info["data_endpoint"]).rsplit(":", 1)[1],
                 "--client-port": str(info["client_endpoint"]).rsplit(":", 1)[1]}
        for flag, port in ports.items():
            if flag in args:
                args[args.index(flag) + 1] = port
            else:
                args += [flag, port]
    return replace(comp, args=tuple(args))


def journaled_decode_places(path: str) -> dict[str, str]:
    """Source -> image.decode_at of the last spec a journal recorded (a run restarted in its run directory keeps
    the place its `auto` sources were given, whatever a new measurement would say)."""
    try:  # read from the end: a long journal's step records are not parsed to find its last spec
        rec = journal.last_record(path, ("open", "spec"))
    except (OSError, ValueError):
        return {}
    spec = rec.get("spec") if rec is not None else None
    if not isinstance(spec, dict):
        return {}
    out = {}
    for s in spec.get("sources") or []:
        place = (s.get("image") or {}).get("decode_at") if isinstance(s, dict) else None
        if isinstance(place, str) and place != "auto" and isinstance(s.get("name"), str):
            out[s["name"]] = place
    return out


class EmbeddedRuntime:
    """Start planner, constructors and loaders as processes; `stop()` leaves none behind."""

    def __init__(self, spec: DataMixtureSpec, run_dir: str | os.PathLike | None = None, *, python: str | None = None,
                 log_level: str = "INFO", restart: RestartPolicy | None = None):
        self.spec = spec
        self.restart = restart
        self.run_dir = Path(run_dir).resolve() if run_dir else default_run_dir(spec)
        self.python = python or sys.executable
        self.log_level = log_level
        self.children: list[Child] = []
        self.planner_endpoint: str | None = None
        self.key_dir = self._key_dir()
        self._saved_env: dict[str, str | None] | None = None
        self._planner_quiet_since: float | None = None
        self._next_hang_check = 0.0
        self.failure: ComponentFailed | None = None  # set by the background supervisor when it gives up
        self._supervisor: threading.Thread | None = None
        self._stop_supervising = threading.Event()
        self._lock = threading.RLock()  # supervise() and stop() from different threads
        # the warm standby (RestartPolicy.standby): a prepared process that becomes the next component to die
        self._standbys: list[tuple[subprocess.Popen, Path]] = []  # (process, its ready file)
        self._standby_serial = 0
        self._standby_due: float | None = None  # when to start the next one (None: none wanted)
        self._standby_deaths = 0  # standbys that died before taking over (a standby that cannot start: give up)

    def _key_dir(self) -> Path | None:
        """Where the run's CURVE keys live: the spec's `runtime.curve.key_dir` when given, else (secure by
        default, or CURVE enabled without a key dir) `<run_dir>/keys`; None for `runtime.security: open`."""
        curve = self.spec.runtime.curve
        if curve.enabled and curve.key_dir:
            return Path(curve.key_dir).resolve()
        if curve.enabled or self.spec.runtime.security == "secure":
            return self.run_dir / KEYS_SUBDIR
        return None

    @property
    def control_curve(self) -> ControlCurve | None:
        """The admin identity of this runtime's control requests (None: an open run)."""
        return ControlCurve(str(self.key_dir), ADMIN_ROLE) if self.key_dir else None

    def curve_setup(self, role: str = "client") -> wire.CurveSetup | None:
        """A role's CURVE setup for in-process peers (a trainer: `MixtureLoader(curve=rt.curve_setup())`)."""
        return wire.CurveSetup.from_dir(self.key_dir, role) if self.key_dir else None

    def client_env(self) -> dict[str, str]:
        """What a trainer process needs to reach this run (`mixplane run` prints it as exports)."""
        env = {"MIXPLANE_PLANNER": self.planner_endpoint or ""}
        if self.key_dir:
            env.update(MIXPLANE_CURVE_DIR=str(self.key_dir), MIXPLANE_CURVE_NAME="client")
        return env

    def _make_keys(self) -> None:
        if self.key_dir is None:
            log.warning("runtime.security is open: any local process that reaches a port of %r can control it "
                        "(shut it down, change its mixture, rewind it)", self.spec.name)
            return
        self.key_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.key_dir, 0o700)
        if not (self.spec.runtime.curve.enabled and self.spec.runtime.curve.key_dir):
            self._inherit_keys()
        wire.ensure_keys(self.key_dir, KEY_ROLES)  # once per run dir; secrets are 0600
        if self.spec.runtime.rank_binding != "off" and self.spec.world_size <= MAX_RANK_KEYS:
            wire.ensure_rank_keys(self.key_dir, self.spec.world_size)  # a rank's batches go only to its key

    def _inherit_keys(self) -> None:
        """Take the key set $MIXPLANE_CURVE_DIR names when it is complete (another runtime of this process,
        or the user's own key store): one trainer environment then reaches every local run at once."""
        src = settings.get("MIXPLANE_CURVE_DIR")
        if not src or self.key_dir is None or Path(src).resolve() == self.key_dir.resolve():
            return
        files = [f"{r}{suffix}" for r in KEY_ROLES for suffix in (wire.PUBLIC_SUFFIX, wire.SECRET_SUFFIX)]
        if not all((Path(src) / f).is_file() for f in files):
            return
        files += sorted(p.name for p in Path(src).glob("client-r*") if p.is_file()
                        and wire.ranks_of_key_name(p.name.split(".")[0]) is not None)
        for f in files:
            data = (Path(src) / f).read_bytes()
            fd = os.open(self.key_dir / f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
        log.info("CURVE keys of this run taken from MIXPLANE_CURVE_DIR=%s", src)

    def _export_client_env(self) -> None:
        """Trainers started from this process (tests, the demo, benchmarks, torchrun children) find the
        client key through the environment MixtureLoader reads; restored by stop()."""
        if self.key_dir is None or self._saved_env is not None:
            return
        self._saved_env = {k: os.environ.get(k) for k in CLIENT_ENV}
        os.environ["MIXPLANE_CURVE_DIR"] = str(self.key_dir)
        os.environ["MIXPLANE_CURVE_NAME"] = "client"

    def _restore_env(self) -> None:
        if self._saved_env is None:
            return
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._saved_env = None

    # -- start ----------------------------------------------------------------------------
    def target(self) -> LaunchTarget:
        return LaunchTarget.local(self.spec, str(self.run_dir), key_dir=str(self.key_dir) if self.key_dir else None)

    def plan(self) -> LaunchPlan:
        """What `start` runs (the planner endpoint is filled in once the planner announced it)."""
        return launch_plan(self.spec, self.target())

    def _spawn(self, comp: Component) -> Child:
        ready = Path(comp.ready_file)
        ready.unlink(missing_ok=True)
        logf = open(self.run_dir / "logs" / f"{comp.name}.log", "ab")
        cmd = [self.python, "-m", "mixplane.cli", "--log-level", self.log_level, *comp.args]
        try:
            proc = _SPAWNER.popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env={**os.environ, **comp.env})
        finally:
            logf.close()
        c = Child(comp.name, proc, ready, component=comp)
        self.children.append(c)
        return c

    # -- warm standbys (RestartPolicy.standby, .standbys) -----------------------------------------
    def _spawn_standby(self) -> None:
        self._standby_serial += 1
        ready = self.run_dir / "ready" / f"standby-{self._standby_serial}.json"
        ready.unlink(missing_ok=True)
        logf = open(self.run_dir / "logs" / "standby.log", "ab")
        cmd = [self.python, "-m", "mixplane.standby", "--ready-file", str(ready)]
        try:
            proc = _SPAWNER.popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        finally:
            logf.close()
        self._standbys.append((proc, ready))

    def _tend_standby(self, now: float) -> None:
        """Keep `standbys` standbys, starting one at a time (`standby_after_s` apart, so a take-over's recovery
        is not slowed by a standby's imports); notice one that died before taking over (started again 5 s later,
        given up after 3 such deaths in a row: restarts then start new interpreters, as without a standby)."""
        if self.restart is None or not self.restart.standby or self._standby_due is None:
            return
        for sb, ready in list(self._standbys):
            if sb.poll() is None:
                continue
            self._standbys.remove((sb, ready))
            ready.unlink(missing_ok=True)
            self._standby_deaths += 1
            giving_up = self._standby_deaths >= 3
            log.warning("a warm standby (pid %d) exited with code %s%s; see %s", sb.pid, sb.returncode,
                        ": no more standbys, restarts start new processes" if giving_up else "",
                        self.run_dir / "logs" / "standby.log")
            if giving_up:
                self._stop_standby()
                return
            self._standby_due = max(self._standby_due, now + 5.0)
        if len(self._standbys) < self.restart.standbys and now >= self._standby_due:
            self._spawn_standby()
            self._standby_due = now + self.restart.standby_after_s

    def _take_standby(self, comp: Component, now: float) -> Child | None:
        """Hand `comp` to a warm standby (a prepared one first): it becomes the component as a new `python -m
        mixplane.cli` would. A standby still preparing takes the order too (it reads it once prepared: always
        sooner than a new process, which would prepare from the start). A loader (whose partitions a shadow can
        serve meanwhile) takes one only when another prepared one stays (with several standbys): that one is kept
        for the planner and the constructors, whose restart the trainers wait for. None: no standby (start a new
        process instead)."""
        live = [(sb, ready) for sb, ready in self._standbys if sb.poll() is None and sb.stdin is not None]
        prepared = [x for x in live if read_ready(x[1]) is not None]
        # a loader leaves a prepared standby behind (one still preparing may take seconds on a loaded machine)
        if not live or (comp.role == "loader" and len(prepared) < 2 and self.restart is not None
                        and self.restart.standbys > 1):
            return None
        sb, ready_file = (prepared or live)[0]
        self._standbys.remove((sb, ready_file))
        ready_file.unlink(missing_ok=True)
        self._standby_deaths = 0
        assert self.restart is not None and sb.stdin is not None and self._standby_due is not None
        self._standby_due = max(self._standby_due, now + self.restart.standby_after_s)
        ready = Path(comp.ready_file)
        ready.unlink(missing_ok=True)
        order = {"argv": ["--log-level", self.log_level, *comp.args], "env": {**os.environ, **comp.env},
                 "log": str(self.run_dir / "logs" / f"{comp.name}.log")}
        try:
            sb.stdin.write((json.dumps(order) + "\n").encode())
            sb.stdin.close()
        except OSError as e:  # it died just now: a new process instead
            log.warning("the warm standby (pid %d) could not take over %s: %s", sb.pid, comp.name, e)
            sb.kill()
            sb.wait(10)
            return None
        c = Child(comp.name, sb, ready, component=comp)
        self.children.append(c)
        log.info("%s: the warm standby (pid %d, %s) takes over", comp.name, sb.pid, "prepared" if prepared else "preparing")
        return c

    def _stop_standby(self) -> None:
        standbys, self._standbys, self._standby_due = self._standbys, [], None
        for sb, _ in standbys:
            if sb.poll() is None:
                try:
                    if sb.stdin is not None:
                        sb.stdin.close()  # end of input: it exits
                except OSError:
                    pass
                sb.send_signal(signal.SIGTERM)
        for sb, ready in standbys:
            try:
                sb.wait(5)
            except subprocess.TimeoutExpired:
                sb.kill()
                sb.wait(5)
            ready.unlink(missing_ok=True)

    def _wait_ready(self, children: list[Child]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for c in children:
            while (info := read_ready(c.ready_file)) is None:
                if c.proc.poll() is not None:
                    tail = (self.run_dir / "logs" / f"{c.name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} while starting:\n{tail}")
                if self._stop_supervising.is_set() and threading.current_thread() is self._supervisor:
                    raise ComponentFailed(f"{c.name}: the runtime stopped while it was being restarted")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{c.name} not ready after {READY_TIMEOUT_S:.0f}s (log: {self.run_dir / 'logs' / (c.name + '.log')})")
                time.sleep(0.01)
            c.info = info
            c.ready_at = time.monotonic()

    def start(self) -> EmbeddedRuntime:
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for sub in ("ready", "logs"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        # the planner journal of an earlier run in this directory is kept (journals/), never deleted
        kept = journal.rotate(self.run_dir / "journal.jsonl")
        if kept:
            log.info("previous journal kept as %s", kept)
        self._make_keys()
        # Iceberg sources read the snapshot current now, in every component and in the journal (loader.iceberg)
        pinned = pin_sources(self.spec)
        for old, new in zip(self.spec.sources, pinned.sources):
            if old.uri != new.uri:
                log.info("source %s: %s pinned to %s", old.name, old.uri, new.uri)
        # image.decode_at auto: the place chosen from measured costs, the same in every component and the journal
        self.spec = resolve_decode_places(pinned, previous=journaled_decode_places(kept) if kept else None)
        plan = self.plan()
        Path(plan.target.spec_file).write_text(self.spec.model_dump_json(indent=1))
        try:
            planner = self._spawn(plan.planner)
            self._wait_ready([planner])
            self.planner_endpoint = planner.info["endpoint"]
            plan = plan.with_planner(self.planner_endpoint)
            rest = [self._spawn(c) for c in plan.components if c.role != "planner"]
            self._wait_ready(rest)
            self._write_endpoints()
            self._export_client_env()
            if self.restart is not None and self.restart.standby:
                self._standby_due = time.monotonic()  # started by the first supervise(): nobody restarts before
        except BaseException:  # re-raised: a start that failed (or was interrupted) leaves no process behind
            self.stop()
            raise
        return self

    def _write_endpoints(self) -> None:
        """<run_dir>/endpoints.json, replaced atomically: a reader (mixplane status --run-dir, a test, a trainer
        launcher) never sees it half written while the supervisor rewrites it after a restart."""
        path = self.run_dir / ENDPOINTS_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.endpoints(), indent=1))
        os.replace(tmp, path)

    def endpoints(self) -> dict[str, Any]:
        return {"planner": self.planner_endpoint, "run_dir": str(self.run_dir),
                "key_dir": str(self.key_dir) if self.key_dir else None,
                "components": {c.name: {**c.info, "pid": c.proc.pid} for c in self.children}}

    # -- control --------------------------------------------------------------------------
    def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        return request(self.planner_endpoint or "", Kind.STATUS, {}, timeout_s, curve=self.control_curve)

    def handoff(self, partition: str, to_host: str, timeout_s: float = 5.0) -> dict[str, Any]:
        """Move a partition ("source:replica") to another loader process at a step boundary (control.handoff)."""
        return control.handoff(self.planner_endpoint or "", partition, to_host, timeout_s, curve=self.control_curve)

    def partitions(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The planner's partition table: which loader process serves (and shadows) each partition."""
        return control.partitions(self.planner_endpoint or "", timeout_s, curve=self.control_curve)

    def add_loader_host(self, name: str, timeout_s: float = 60.0, *, shadows: int = 0) -> Child:
        """Start a loader process with no partitions (it serves what the planner hands it) and `shadows` shadow
        processes beside it (`<name>-shadow<i>`, `--shadow-of name`: each stands by for what that host is handed,
        planner.partitions' groups), and wait until the planner lists them all alive. Returns the primary's child."""
        plan = self.plan()
        started = []
        for host, shadow in [(name, False), *((shadow_name(name, i), True) for i in range(shadows))]:
            ready = str(self.run_dir / "ready" / f"{host}.json")
            args = ["loader", "--spec", plan.target.spec_file, "--ready-file", ready, "--host-name", host,
                    *(("--shadow", "--shadow-of", name) if shadow else ()), "--planner", self.planner_endpoint or ""]
            if self.key_dir:
                args += ["--curve-dir", str(self.key_dir)]
            with self._lock:
                started.append(self._spawn(Component("loader", host, tuple(args), env={"PYTHONUNBUFFERED": "1"},
                                                     ready_file=ready, shadow=shadow)))
        self._wait_ready(started)
        deadline = time.monotonic() + timeout_s
        while not all((hosts := self.partitions().get("hosts", {})).get(c.name, {}).get("alive") for c in started):
            if time.monotonic() > deadline:
                missing = [c.name for c in started if not hosts.get(c.name, {}).get("alive")]
                raise TimeoutError(f"loader host {', '.join(missing)} did not register with the planner within "
                                   f"{timeout_s:g}s")
            time.sleep(0.05)
        return started[0]

    def repartition(self, source: str, partitions: int, *, step: int | None = None, timeout_s: float = 60.0,
                    wait: bool = True) -> dict[str, Any]:
        """Read `source` with `partitions` partitions from `step` (default: the first step not planned) on
        (mixplane.repartition; control.repartition). Partition k below the current count stays in its process;
        each further one gets a loader process of its own, started here first with `runtime.shadow_loaders`
        shadows beside it (the planner has them stand by for it once the host serves it: every partition keeps
        its shadows across the change). With `wait`, returns once the
        planner applied it (its STATUS entry: step, from, partitions, hosts, applied_after_s)."""
        st = self.status()
        names = st.get("sources", [])
        if source not in names:
            raise ValueError(f"source: no source {source!r} (the mixture has {', '.join(names)})")
        # what only the files can say (the planner has no index): enough blocks, pages or row groups for every partition
        from mixplane.checks import partition_problem

        src = self.spec.sources[names.index(source)]
        if 1 <= int(partitions) <= 1024 and (why := partition_problem(src, int(partitions), self.spec.mixture.seed)):
            raise ValueError(f"partitions: {why}")
        old = int(st.get("source_partitions", {}).get(source, 0))
        table = st.get("partitions", {})
        hosts: list[str] = []
        for k in range(int(partitions)):
            cur = table.get(f"{source}:{k}", {}).get("host") if k < old else None
            if cur is None:
                n = 0
                while f"loader-{source}-p{k}-{n}" in {c.name for c in self.children}:
                    n += 1
                cur = f"loader-{source}-p{k}-{n}"
                self.add_loader_host(cur, timeout_s, shadows=int(self.spec.runtime.shadow_loaders))
            hosts.append(cur)
        ack = control.repartition(self.planner_endpoint or "", source, int(partitions), timeout_s, step=step,
                                  hosts=hosts if 1 <= int(partitions) <= 1024 else None, curve=self.control_curve)
        if not wait:
            return ack
        deadline = time.monotonic() + timeout_s
        while True:
            for r in reversed(self.status().get("repartitions", [])):
                if r["source"] == source and r["step"] == ack["step"]:
                    if r.get("error"):
                        raise RuntimeError(f"re-partition of {source!r} not applied: {r['error']}")
                    if r.get("applied"):
                        return r
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"re-partition of {source!r} at step {ack['step']} not applied within {timeout_s:g}s")
            time.sleep(0.05)
    def child(self, name: str) -> Child:
        """The current incarnation of a component (safe while the background supervisor restarts it)."""
        with self._lock:
            return next(c for c in self.children if c.name == name)

    def alive(self) -> list[str]:
        return [c.name for c in self.children if c.proc.poll() is None]

    def dead(self) -> list[tuple[str, int]]:
        return [(c.name, c.proc.returncode) for c in self.children if c.proc.poll() is not None]

    def supervise(self, now: float | None = None) -> list[str]:
        """Look after the children once (call it every second or so): restart the dead ones the policy
        allows, once their backoff has passed; returns the names restarted. Raises ComponentFailed for a
        child that died and may not (or no longer) be restarted."""
        with self._lock:
            return self._supervise(time.monotonic() if now is None else now)

    def _kill_hung(self, now: float) -> None:
        """SIGKILL components silent past the policy's hang_after_s (then restarted like dead ones): the planner
        when it answers no STATUS, and those its STATUS lists silent (constructors, loader hosts)."""
        assert self.restart is not None and self.restart.hang_after_s is not None
        hang = self.restart.hang_after_s
        try:
            st = self.status(timeout_s=min(2.0, hang))
        except (TimeoutError, RuntimeError, OSError):
            since = self._planner_quiet_since = self._planner_quiet_since or now
            planner = next((c for c in self.children if c.name == "planner"), None)
            if planner is not None and planner.proc.poll() is None and now - since > hang and now - planner.started > hang:
                log.error("planner answered no status request for %.1f s (hung): killing it to restart it", now - since)
                planner.proc.kill()
                planner.proc.wait(10)
                self._planner_quiet_since = None
            return
        self._planner_quiet_since = None
        by_peer = {f"constructor:{c.component.index}": c for c in self.children
                   if c.component is not None and c.component.role == "constructor" and c.component.index is not None}
        by_peer.update({f"beat:{c.name}": c for c in self.children if c.component is not None and c.component.role == "loader"})
        for peer, quiet in (st.get("silent") or {}).items():
            c = by_peer.get(peer)
            if c is None or c.proc.poll() is not None or not isinstance(quiet, (int, float)):
                continue
            if quiet > hang and now - c.started > quiet:  # silent since this incarnation started: hung
                log.error("%s silent for %.1f s (hung): killing it to restart it", c.name, quiet)
                c.proc.kill()
                c.proc.wait(10)

    def _supervise(self, now: float) -> list[str]:
        hang = self.restart.hang_after_s if self.restart is not None else None
        if hang is not None and self.planner_endpoint and now >= self._next_hang_check:
            self._next_hang_check = now + min(1.0, hang / 4)
            self._kill_hung(now)
        restarted = self._started(now)
        self._tend_standby(now)
        for i, c in enumerate(self.children):
            code = c.proc.poll()
            if code is None:
                continue
            log_file = self.run_dir / "logs" / f"{c.name}.log"
            role = c.component.role if c.component is not None else ""
            if code == EXIT_LISTING:  # refused by the run (its listing of a source): a restart would be refused too
                raise ComponentFailed(f"{c.name} exited with code {code}: it must not serve this run and is not "
                                      f"restarted: {last_error(log_file) or 'see its log'}; see {log_file}")
            if self.restart is None or role not in self.restart.roles:
                raise ComponentFailed(f"{c.name} exited with code {code}; see {log_file}")
            if c.restart_at is None:
                wait = self.restart.delay(c.restarts, now, None if c.ready_at is None else now - c.ready_at)
                if wait is None:
                    raise ComponentFailed(f"{c.name} exited with code {code} and was restarted {len(c.restarts)} times "
                                          f"within {self.restart.window_s:g}s (the budget): giving up; exit codes of its "
                                          f"incarnations: {[*c.exit_codes, code]}; see {log_file}")
                c.restart_at = now + wait
                log.warning("%s (%s) exited with code %s; restarting in %.1fs", c.name, role, code, wait)
            if now >= c.restart_at:
                assert c.component is not None
                self.children.pop(i)
                comp = pinned(c.component, c.info)
                # appended: moved back to its place below
                fresh = self._take_standby(comp, now) or self._spawn(comp)
                fresh.component = c.component
                self.children.remove(fresh)
                self.children.insert(i, fresh)
                fresh.restarts = [*c.restarts, now]
                fresh.exit_codes = [*c.exit_codes, code]
                fresh.info = dict(c.info)  # its endpoints: pinned, the same as its predecessor's
                fresh.starting = True
        # not waited for here: another component that died meanwhile is restarted at once, not after this one
        # started (a new interpreter takes seconds on a loaded machine)
        restarted += self._started(time.monotonic(), wait_s=RESTART_WAIT_S)
        if restarted:
            self._write_endpoints()
        return restarted

    def _started(self, now: float, wait_s: float = 0.0) -> list[str]:
        """The restarted incarnations that announced themselves ready (within `wait_s`: a standby takes over in
        ~0.1 s); one that died while starting is another exit (restarted by the policy on the next look, its
        budget counts it), one not ready after READY_TIMEOUT_S is killed (likewise)."""
        done: list[str] = []
        deadline = now + wait_s
        while True:
            pending = False
            for c in self.children:
                if not c.starting:
                    continue
                info = read_ready(c.ready_file)
                if info is not None:
                    c.starting, c.ready_at = False, time.monotonic()
                    c.info = {**c.info, **info}
                    done.append(c.name)
                    log.warning("%s restarted (pid %d, restart %d)", c.name, c.proc.pid, len(c.restarts))
                elif c.proc.poll() is not None:
                    c.starting = False
                    log.warning("%s did not start: exited with code %s while starting (see %s)", c.name,
                                c.proc.returncode, self.run_dir / "logs" / f"{c.name}.log")
                elif time.monotonic() - c.started > READY_TIMEOUT_S:
                    c.starting = False
                    log.warning("%s did not start: not ready after %.0fs; killing it", c.name, READY_TIMEOUT_S)
                    c.proc.kill()
                    c.proc.wait(10)
                else:
                    pending = True
            if not pending or time.monotonic() >= deadline or self._stop_supervising.is_set():
                return done
            if any(c.proc.poll() is not None for c in self.children if not c.starting):
                return done  # another death: it is restarted on the next look, not after this wait
            time.sleep(0.01)

    def reshard(self, topology: dict[str, Any], state: dict[str, Any] | None = None, *, attempt: str | None = None,
                reshard_id: str | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
        """Elastic resharding of the running data plane: the trainer's topology becomes
        `topology` (a spec `topology` mapping: modules with dp / pp / cp / tp) from the step of `state`
        (a rank's `MixtureLoader.state_dict()`, or its cursor) on; the global batch stays the same.

        The planner checks and adopts it (journaled), tells the old constructors to stop and rewinds to the
        state's step; this method then starts the new topology's constructors from its launch plan. The
        spec file is rewritten, so components restarted later start with the new topology. Trainer ranks
        of the new world resume with `load_state_dict(state)`; with MIXPLANE_RESUME_ID set to `attempt`
        their resumes do not replan what was planned since. Returns the planner's answer (step, generation,
        world_size, constructors, spec).

        Without `state`, with a `reshard_id` (what the operator sends for a patch of spec.topology): the planner
        takes the first step it has not planned, with its own cursor there; the answer says which (`step`). An id
        is applied once: the same id again is answered with the same step (`duplicate`) and changes nothing."""
        from mixplane.spec import DataMixtureSpec as _Spec

        cursor = None if state is None else state.get("cursor") if "windows" not in state else state
        if state is None and reshard_id is None:
            raise ValueError("reshard needs a state_dict (or cursor), or a reshard_id (from the next step not planned)")
        if state is not None and not isinstance(cursor, dict):
            raise ValueError("reshard needs a state_dict (or cursor) saved after the first step")
        before = list(self.children)
        old = [c for c in before if c.component is not None and c.component.role == "constructor"]
        self.children = [c for c in before if c not in old]  # their exit is on purpose, not a failure
        self._rank_keys_for(topology)  # ranks a bigger world adds get their keys before they knock
        meta: dict[str, Any] = {"topology": topology}
        if cursor is not None:
            meta["cursor"] = cursor
        if attempt is not None:
            meta["attempt"] = attempt
        if reshard_id is not None:
            meta["reshard_id"] = reshard_id
        t_end = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    reply = request(self.planner_endpoint or "", Kind.RESHARD, meta, timeout_s, curve=self.control_curve)
                    break
                except RuntimeError as e:  # a restarted planner still recovering its session: ask again
                    if "recovering" not in str(e) or time.monotonic() > t_end:
                        raise
                    time.sleep(0.2)
        except BaseException:  # re-raised: a reshard the planner did not take keeps the children it had
            self.children = before
            raise
        if reply.get("duplicate"):
            self.children = before  # acknowledged before: nothing was stopped, nothing to start
            return reply
        new = _Spec.model_validate(reply["spec"])
        if self.key_dir is not None and new.runtime.rank_binding != "off" and new.world_size <= MAX_RANK_KEYS:
            wire.ensure_rank_keys(self.key_dir, new.world_size)  # ranks of the new world get their keys too
        deadline = time.monotonic() + timeout_s
        for c in old:  # the planner told them to stop; make sure before their names are reused
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(5)
        self.spec = new
        plan = self.plan()
        tmp = Path(plan.target.spec_file + ".tmp")
        tmp.write_text(new.model_dump_json(indent=1))
        os.replace(tmp, plan.target.spec_file)
        assert self.planner_endpoint is not None
        fresh = [self._spawn(c) for c in plan.with_planner(self.planner_endpoint).components if c.role == "constructor"]
        self._wait_ready(fresh)
        self._write_endpoints()
        log.warning("resharded at step %s: %d constructor(s) replaced by %d", reply.get("step"), len(old), len(fresh))
        return reply
    def supervise_in_background(self, interval_s: float = 0.2) -> threading.Thread:
        """Run :meth:`supervise` every `interval_s` in a daemon thread until stop(); when it gives up, the
        ComponentFailed is kept in :attr:`failure` (and raised by :meth:`check`)."""
        if self._supervisor is not None:
            return self._supervisor

        def loop() -> None:
            while not self._stop_supervising.wait(interval_s):
                try:
                    for name in self.supervise():
                        log.info("supervisor: restarted %s", name)
                except ComponentFailed as e:
                    self.failure = e
                    log.error("supervisor: %s", e)
                    return
                except Exception as e:  # noqa: BLE001 - a restart that failed to start: report, stop supervising
                    self.failure = ComponentFailed(f"supervision failed: {type(e).__name__}: {e}")
                    log.error("supervisor: %s", self.failure)
                    return

        self._stop_supervising.clear()
        self._supervisor = threading.Thread(target=loop, name="mixplane-supervisor", daemon=True)
        self._supervisor.start()
        return self._supervisor

    def check(self) -> None:
        """Raise the background supervisor's ComponentFailed, if it gave up."""
        if self.failure is not None:
            raise self.failure

    def _rank_keys_for(self, topology: dict[str, Any]) -> None:
        """Rank-bound client keys for every rank of a new topology's world (servers re-read the allowlist
        when an unknown key knocks); nothing for an open run or when ranks are not bound to keys."""
        from mixplane.spec import TopologySpec

        if self.key_dir is None or self.spec.runtime.rank_binding == "off":
            return
        try:
            world = TopologySpec.model_validate(topology).backbone()[1].world
        except (ValueError, KeyError):  # not a valid topology (ValidationError) or no backbone: the planner names it
            return
        if world <= MAX_RANK_KEYS:
            wire.ensure_rank_keys(self.key_dir, world)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop_supervising.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout_s)
        self._supervisor = None
        self._restore_env()
        with self._lock:
            self._stop_standby()
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

    def __enter__(self) -> EmbeddedRuntime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

