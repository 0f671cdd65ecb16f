"""Several logical Source Loaders in one process (the paper's source grouping).

Each source keeps its own :class:`~mixplane.loader.server.LoaderServer` state (planner socket,
window, stream, pushers) — to the planner they are separate loaders — but they share one process,
one ZeroMQ context and one poll loop, so a job with hundreds of small sources does not pay a Python
interpreter per source. The partitioner decides the grouping; `mixplane.runtime` / pods may host a
group with::

    python -m mixplane.loader.group --spec SPEC.json --planner EP --sources a,b,c[:replica] [--ready-file F]
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import zmq

from mixplane.loader.server import LoaderServer, serve_loaders
from mixplane.spec import DataMixtureSpec

log = logging.getLogger("mixplane.loader.group")


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mixplane.loader.group", description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--planner", required=True)
    ap.add_argument("--sources", required=True, help="comma-separated source names, each optionally name:replica")
    ap.add_argument("--ready-file")
    ap.add_argument("--max-seconds", type=float)
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING))
    spec = DataMixtureSpec.model_validate_json(Path(args.spec).read_text())
    group = SourceGroup(spec, parse_members(spec, args.sources), args.planner)

    def stop(*_: object) -> None:
        group.stopped = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    from mixplane.runtime import write_ready

    write_ready(args.ready_file, {"sources": args.sources})
    group.run(max_seconds=args.max_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
