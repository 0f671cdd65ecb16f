"""The launch plan: which components one mixture runs, with which arguments, ports and partitions.

Pure data from a spec and a :class:`LaunchTarget` (no sockets, no processes, no Kubernetes): the
embedded runtime (`mixplane.runtime`) starts the plan as local processes, the operator renders the
same plan into pod manifests. Everything that differs between the two — hosts, ports, the run
directory, where keys are mounted — is a field of the target, never hard-coded here.

Every component runs the `mixplane` command (`mixplane planner|constructor|loader ...`); `Component.args`
is what follows `mixplane`. Loaders and constructors connect to the planner: when the planner's port
is picked at start (local runs, port 0), their args hold :data:`PLANNER_PLACEHOLDER` until
:meth:`LaunchPlan.with_planner` fills in the endpoint the planner announced.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Literal

from mixplane.spec import DataMixtureSpec
from mixplane.topology import constructor_groups

Role = Literal["planner", "constructor", "loader"]
PLANNER_PLACEHOLDER = "{planner}"
MiB = 1 << 20


@dataclass(frozen=True)
class LaunchTarget:
    """Where a plan runs. Local defaults; a cluster sets hosts, fixed ports and mounted paths.

    run_dir: the component-visible directory of spec.json, ready files and the planner journal.
    bind_host: the interface servers bind to (0.0.0.0 in a pod).
    planner_host / planner_port: how other components reach the planner (a Service name in a cluster);
        port 0 = a free port picked at start (only local runs), announced in the planner's ready file.
    spec_path: the resolved spec (JSON) every component reads; default run_dir/spec.json.
    key_dir: CURVE key directory (role key pairs); None runs without CURVE.
    constructor_ports: (data, clients) ports every constructor binds; 0 = free ones (fixed in a pod).
    advertise_host: the address constructors announce instead of bind_host (e.g. "$(POD_IP)" when
        binding 0.0.0.0); None announces the bound address.
    metrics_port: Prometheus port of the planner, each constructor and each loader process; 0 = a free one
        (a loader process hosting a group then serves one free port per Source Loader; a fixed port serves them
        all, merged).
    """

    run_dir: str
    bind_host: str = "127.0.0.1"
    planner_host: str = "127.0.0.1"
    planner_port: int = 0
    spec_path: str | None = None
    key_dir: str | None = None
    metrics_port: int = 0
    constructor_ports: tuple[int, int] = (0, 0)
    advertise_host: str | None = None

    @property
    def spec_file(self) -> str:
        return self.spec_path or os.path.join(self.run_dir, "spec.json")

    @property
    def planner_endpoint(self) -> str | None:
        """The endpoint others connect to, when known before start."""
        return f"tcp://{self.planner_host}:{self.planner_port}" if self.planner_port else None

    @classmethod
    def local(cls, spec: DataMixtureSpec, run_dir: str, *, key_dir: str | None = None) -> LaunchTarget:
        """The embedded runtime's target: everything on `runtime.host`, the planner on `runtime.planner_port`."""
        h = spec.runtime.host
        return cls(run_dir=run_dir, bind_host=h, planner_host=h, planner_port=spec.runtime.planner_port, key_dir=key_dir)


@dataclass(frozen=True)
class Partition:
    """One Source Loader: replica `replica` of source `source` (replicas partition a source disjointly)."""

    source: str
    replica: int

    def __str__(self) -> str:
        return f"{self.source}:{self.replica}"


@dataclass(frozen=True)
class Resources:
    """Scheduling hints: cores a component keeps busy and a memory estimate (requests, not limits)."""

    cpu: float
    memory_bytes: int


@dataclass(frozen=True)
class Component:
    """One process / pod of the plan."""

    role: Role
    name: str  # unique within the plan; also the ready-file and log-file stem
    args: tuple[str, ...]  # after `mixplane`
    env: dict[str, str] = field(default_factory=dict)
    binds: dict[str, str] = field(default_factory=dict)  # socket -> bind endpoint (port 0: picked at start)
    ports: dict[str, int] = field(default_factory=dict)  # named container ports (0: picked at start)
    partitions: tuple[Partition, ...] = ()  # loaders: the Source Loaders this process hosts
    index: int | None = None  # constructors: the constructor index
    ranks: tuple[int, ...] = ()  # constructors: the global ranks served
    resources: Resources = Resources(1.0, 256 * MiB)
    ready_file: str = ""
    shadow: bool = False  # loaders: a hot standby of `partitions` (runtime.shadow_loaders), serving nothing until promoted

    @property
    def dns_name(self) -> str:
        """`name` as a DNS-1123 label (pods, services): lowercase [a-z0-9-], at most 63 characters."""
        s = re.sub(r"[^a-z0-9-]+", "-", self.name.lower()).strip("-")
        return s[:63].rstrip("-") or self.role

    def argv(self, executable: tuple[str, ...] = ("mixplane",)) -> list[str]:
        return [*executable, *self.args]


@dataclass(frozen=True)
class LaunchPlan:
    """All components of one mixture, planner first."""

    spec_name: str
    target: LaunchTarget
    components: tuple[Component, ...]

    @property
    def planner(self) -> Component:
        return next(c for c in self.components if c.role == "planner")

    def of_role(self, role: Role) -> list[Component]:
        return [c for c in self.components if c.role == role]

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r} in the launch plan of {self.spec_name!r}")

    @property
    def needs_planner_endpoint(self) -> bool:
        return any(PLANNER_PLACEHOLDER in c.args for c in self.components)

    def with_planner(self, endpoint: str) -> LaunchPlan:
        """The plan with the planner endpoint (announced by the started planner) in every component's args."""
        comps = tuple(replace(c, args=tuple(endpoint if a == PLANNER_PLACEHOLDER else a for a in c.args))
                      for c in self.components)
        return replace(self, components=comps)


# -------------------------------------------------------------------------------------- grouping
def loader_groups(spec: DataMixtureSpec) -> list[list[tuple[str, int]]]:
    """(source, replica) pairs hosted together, `runtime.sources_per_loader` per process, in spec order."""
    pairs = [(s.name, r) for s in spec.sources for r in range(s.replicas)]
    n = spec.runtime.sources_per_loader
    return [pairs[i : i + n] for i in range(0, len(pairs), n)]


def loader_name(group: list[tuple[str, int]]) -> str:
    """`loader-<source>-<replica>` for one Source Loader, `loaders-<first>-<replica>+<more>` for a group."""
    name, r = group[0]
    return f"loader-{name}-{r}" if len(group) == 1 else f"loaders-{name}-{r}+{len(group) - 1}"


# -------------------------------------------------------------------------------------- estimates
_BASE = 192 * MiB  # an interpreter with numpy, pyarrow, zmq and the spec loaded


def _loader_resources(spec: DataMixtureSpec, group: list[tuple[str, int]]) -> Resources:
    """Per Source Loader: its shuffle buffer (decoded bytes, x2 while refilling) plus its window's tokens."""
    mem = _BASE
    for name, _ in group:
        si = spec.source_index(name)
        src = spec.sources[si]
        buf = src.shuffle_buffer_mb if src.shuffle_buffer_mb is not None else 32.0
        _, window_tokens, _ = spec.window_bounds(si)
        mem += int(2 * buf * MiB) + 8 * window_tokens + 32 * MiB
    return Resources(cpu=1.0, memory_bytes=mem)


def steps_held(spec: DataMixtureSpec) -> int:
    """Steps a constructor may hold built at once: what its clients keep requested ahead -- `prefetch_s` sizes
    that by the trainer's measured step time, up to `max_lead_steps` (a trainer with short steps reaches the
    bound), else `prefetch_steps` -- plus the step being built and the one being handed out."""
    rt = spec.runtime
    return max(rt.prefetch_steps, rt.max_lead_steps if rt.prefetch_s > 0 else 0) + 2


def _constructor_resources(spec: DataMixtureSpec, n_constructors: int) -> Resources:
    """steps_held steps of its share of a step, ~5 int32/int64 arrays per token. Sized for the look-ahead's bound:
    in a cluster the memory limit is a multiple of this request, and a constructor over it is killed."""
    share = spec.tokens_per_step // max(1, n_constructors)
    return Resources(cpu=1.0, memory_bytes=_BASE + steps_held(spec) * share * 24)


def _planner_resources(spec: DataMixtureSpec) -> Resources:
    """The windows' metadata (~64 B a sample, up to window_max per replica) and the plan of a step."""
    replicas = sum(s.replicas for s in spec.sources)
    return Resources(cpu=1.0, memory_bytes=_BASE + replicas * spec.runtime.window_max * 64 + spec.tokens_per_step * 32)


# -------------------------------------------------------------------------------------- the plan
def _common(target: LaunchTarget, name: str, *, fixed_metrics: bool = True) -> tuple[list[str], str]:
    ready = os.path.join(target.run_dir, "ready", f"{name}.json")
    args = ["--spec", target.spec_file, "--ready-file", ready]
    if target.key_dir:
        args += ["--curve-dir", target.key_dir]
    if target.metrics_port and fixed_metrics:
        args += ["--metrics-port", str(target.metrics_port)]
    return args, ready


def launch_plan(spec: DataMixtureSpec, target: LaunchTarget, *,
                loaders: list[list[tuple[str, int]]] | None = None) -> LaunchPlan:
    """Planner, one constructor per constructor group, one loader process per loader group.

    `loaders`: the (source, replica) pairs each loader process hosts, when something else decided them
    (the operator's auto-partitioner); default `runtime.sources_per_loader` per process in spec order."""
    env = {"PYTHONUNBUFFERED": "1"}
    planner_ep = target.planner_endpoint or PLANNER_PLACEHOLDER
    ports_metrics = {"metrics": target.metrics_port} if spec.runtime.metrics else {}
    comps: list[Component] = []

    common, ready = _common(target, "planner")
    bind = f"tcp://{target.bind_host}:{target.planner_port or '*'}"
    comps.append(Component("planner", "planner", ("planner", *common, "--bind", bind, "--run-dir", target.run_dir),
                           env=dict(env), binds={"planner": bind}, ports={"planner": target.planner_port, **ports_metrics},
                           resources=_planner_resources(spec), ready_file=ready))

    groups = constructor_groups(spec)
    for i, ranks in enumerate(groups):
        name = f"constructor-{i}"
        common, ready = _common(target, name)
        dport, cport = target.constructor_ports
        binds = {"data": f"tcp://{target.bind_host}:{dport}", "clients": f"tcp://{target.bind_host}:{cport}"}
        extra: tuple[str, ...] = ()
        if dport or cport:
            extra += ("--data-port", str(dport), "--client-port", str(cport))
        if target.advertise_host:
            extra += ("--advertise-host", target.advertise_host)
        comps.append(Component("constructor", name,
                               ("constructor", *common, "--index", str(i), "--planner", planner_ep, "--host", target.bind_host,
                                *extra),
                               env=dict(env), binds=binds, ports={"data": dport, "clients": cport, **ports_metrics}, index=i,
                               ranks=tuple(int(r) for r in ranks), resources=_constructor_resources(spec, len(groups)),
                               ready_file=ready))

    for group in (loader_groups(spec) if loaders is None else [list(g) for g in loaders]):
        primary = loader_name(group)
        # runtime.shadow_loaders hot standbys per group: same partitions, `--shadow` (planner.partitions)
        for name, shadow in [(primary, False), *((shadow_name(primary, i), True) for i in range(spec.runtime.shadow_loaders))]:
            common, ready = _common(target, name)
            if len(group) == 1:
                src, r = group[0]
                which: tuple[str, ...] = ("--source", src, "--replica", str(r))
            else:
                which = ("--sources", ",".join(f"{n}:{r}" for n, r in group))
            which += ("--host-name", name, *(("--shadow", "--shadow-of", primary) if shadow else ()))
            if spec.runtime.loader_snapshot_every:  # differential checkpoints in the run dir (loader.snapshot)
                which += ("--state-dir", os.path.join(target.run_dir, "loader-state"))
            comps.append(Component("loader", name, ("loader", *common, *which, "--planner", planner_ep),
                                   env={**env, "TOKENIZERS_PARALLELISM": "false"},
                                   ports=dict(ports_metrics),
                                   partitions=tuple(Partition(n, r) for n, r in group),
                                   resources=_loader_resources(spec, group), ready_file=ready, shadow=shadow))
    return LaunchPlan(spec.name, target, tuple(comps))


def shadow_name(primary: str, i: int) -> str:
    """The i-th (0-based) shadow of the loader group named `primary`: `<primary>-shadow<i+1>`."""
    return f"{primary}-shadow{i + 1}"
