"""A warm standby process for the embedded runtime's restarts: a restarted component takes over a process
that has already imported and initialised, so the restart stall is the hand-over, not a Python start-up.

A restart used to pay a new interpreter: starting Python and importing a component (numpy, pyarrow, zmq,
pydantic, numba and the planner's compiled loops loaded from numba's cache) took 1-3.5 s on a loaded 2-core
machine, most of a planner restart. The runtime keeps one standby that has paid all of that already and waits,
idle, on its stdin. When a supervised component dies, the runtime writes that component's command line to the
standby; the standby becomes the component exactly as ``python -m mixplane.cli ARGV`` would (the same argv,
environment, log file and stdin), and a new standby is started behind it.

Nothing of the component's state exists in the standby before the order arrives: it has not opened the journal,
read the spec or bound a socket (the dead component's endpoints are bound by whoever takes over, after the
death). So the recovery that follows is the one of a cold restart, only sooner.

The order is one line of JSON on stdin (never a pickle): ``{"argv": [...], "env": {...}, "log": PATH}``;
end of input (the runtime stopped) ends the standby.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from typing import Any

from mixplane.errors import MixplaneError

# what a component's start imports and compiles, paid before the order (mixplane.cli's commands import these)
MODULES = ("mixplane.cli", "mixplane.control", "mixplane.planner.server", "mixplane.constructor.server",
           "mixplane.loader.host", "mixplane.loader.memory")


class OrderError(MixplaneError, ValueError):
    """A take-over order that is not what the runtime writes."""


def parse_order(line: str) -> dict[str, Any]:
    """The take-over order (one JSON line): argv (the arguments of `mixplane.cli`), env (the component's whole
    environment) and log (the file its stdout and stderr go to)."""
    try:
        order = json.loads(line)
    except ValueError as e:
        raise OrderError(f"standby order is not JSON: {e}") from None
    if not isinstance(order, dict):
        raise OrderError("standby order: expected an object with argv, env, log")
    argv, env, log = order.get("argv"), order.get("env"), order.get("log")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise OrderError("standby order: field argv must be a non-empty list of strings")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise OrderError("standby order: field env must map strings to strings")
    if not isinstance(log, str) or not log:
        raise OrderError("standby order: field log must be a file path")
    return {"argv": list(argv), "env": dict(env), "log": log}


def prepare() -> float:
    """Import every component's modules and load the planner's compiled loops; returns the seconds it took."""
    t0 = time.monotonic()
    for name in MODULES:
        importlib.import_module(name)
    from mixplane.planner import layoutloop, routeloop, selectloop

    selectloop.warm()
    routeloop.warm()
    layoutloop.warm()
    return time.monotonic() - t0


def become(order: dict[str, Any]) -> int:
    """Turn this process into the component of `order`: its log on stdout and stderr, /dev/null on stdin,
    its environment, its argv; then run it (`mixplane.cli.main`)."""
    from mixplane import cli

    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(order["env"])
    sys.argv = [cli.__file__, *order["argv"]]
    return cli.main(order["argv"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mixplane.standby", description=__doc__.splitlines()[0])
    ap.add_argument("--ready-file", required=True, help="written once the standby is prepared")
    args = ap.parse_args(argv)
    from mixplane.control import write_ready

    took = prepare()
    print(f"standby pid {os.getpid()} prepared in {took:.2f} s; waiting for a component to take over", flush=True)
    write_ready(args.ready_file, {"pid": os.getpid(), "prepared_s": round(took, 3)})
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the runtime stopped (end of input)
    order = parse_order(line)
    print(f"standby pid {os.getpid()}: taking over as {' '.join(order['argv'])} (log {order['log']})", flush=True)
    return become(order)


if __name__ == "__main__":
    sys.exit(main())
