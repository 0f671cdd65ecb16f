"""Several logical Source Loaders in one process (the paper's source grouping).

Each source keeps its own :class:`~mixplane.loader.server.LoaderServer` state (planner socket,
window, stream, pushers) — to the planner they are separate loaders — but they share one process,
one ZeroMQ context and one poll loop, so a job with hundreds of small sources does not pay a Python
interpreter per source. `runtime.sources_per_loader` (or the operator's auto-partitioner) decides the
grouping; `mixplane.launch` plans a group (the runtime / pods host it) with the loader command (one code path: allocator and
tokenizer settings included)::

    mixplane loader --spec SPEC.json --planner EP --sources a,b,c[:replica] [--ready-file F]
"""

from __future__ import annotations

import zmq

from mixplane.loader.server import LoaderServer, serve_loaders
from mixplane.spec import DataMixtureSpec


class SourceGroup:
    """Hosts LoaderServers for (source index, replica) pairs in one poll loop."""

    def __init__(self, spec: DataMixtureSpec, members: list[tuple[int, int]], planner_endpoint: str,
                 *, context: zmq.Context | None = None, metrics: bool = False):
        if not members:
            raise ValueError("a source group needs at least one (source, replica)")
        self.ctx = context or zmq.Context.instance()
        self.loaders = [LoaderServer(spec, si, r, planner_endpoint, context=self.ctx, metrics_port=0 if metrics else None)
                        for si, r in members]
        self.stopped = False

    def run(self, *, max_seconds: float | None = None) -> None:
        serve_loaders(self.loaders, lambda: self.stopped, max_seconds=max_seconds)


def parse_members(spec: DataMixtureSpec, text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, rep = item.partition(":")
        out.append((spec.source_index(name), int(rep or 0)))
    return out
