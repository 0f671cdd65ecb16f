"""The `mixplane` command: validate, run, demo, replay, status, update, and component entrypoints."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from mixplane import podend, settings

EXIT_INVALID = 2
DEFAULT_RESTARTS = 3  # `mixplane run`: a component that dies is restarted (at most this often in 5 minutes)
SUPERVISE_EVERY_S = 0.2  # `mixplane run` looks after its components this often (on a thread of its own)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _load(path: str):
    from mixplane.checks import default_checks
    from mixplane.spec import SpecError, load_spec

    try:
        return load_spec(path, checks=default_checks())
    except SpecError as e:
        for p in e.problems:
            print(f"{e.origin}: {p}", file=sys.stderr)
        raise SystemExit(EXIT_INVALID) from None


def _load_resolved(path: str):
    """Specs written by the runtime (JSON, paths already absolute)."""
    from mixplane.spec import DataMixtureSpec

    return DataMixtureSpec.model_validate_json(Path(path).read_text())


def _component_spec(args: argparse.Namespace):
    """The resolved spec of a component, with the key directory its launch plan gave it (--curve-dir)."""
    spec = _load_resolved(args.spec)
    if getattr(args, "curve_dir", None):
        curve = spec.runtime.curve.model_copy(update={"enabled": True, "key_dir": args.curve_dir})
        spec = spec.model_copy(update={"runtime": spec.runtime.model_copy(update={"curve": curve})})
    return spec


def _on_sigterm(server: Any) -> None:
    def stop(*_: object) -> None:
        server.stopped = True
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


# ---- commands ---------------------------------------------------------------------------

def cmd_validate(args: argparse.Namespace) -> int:
    from mixplane.checks import default_checks
    from mixplane.spec import SpecError, load_spec

    checks = default_checks(files=not args.no_files)
    bad = 0
    for f in args.files:
        try:
            load_spec(f, checks=checks)
        except SpecError as e:
            for p in e.problems:
                print(f"{e.origin}: {p}")
            bad += 1
        except Exception as e:  # noqa: BLE001 - validate never tracebacks; a bug in a check is named, not thrown
            print(f"{f}: <file>: cannot validate ({type(e).__name__}: {e})")
            bad += 1
        else:
            if not args.quiet:
                print(f"{f}: valid", file=sys.stderr)
    return EXIT_INVALID if bad else 0


def cmd_planner(args: argparse.Namespace) -> int:
    from mixplane.planner.server import PlannerServer, tune_gc
    from mixplane.control import write_ready

    spec = _component_spec(args)
    srv = PlannerServer(spec, args.bind, run_dir=args.run_dir, metrics_port=args.metrics_port)
    tune_gc()  # this process only plans: start-up objects frozen out of every later collection
    _on_sigterm(srv)
    write_ready(args.ready_file, {"endpoint": srv.endpoint, "metrics_port": srv.metrics_port})
    srv.run()
    return 0


def cmd_constructor(args: argparse.Namespace) -> int:
    from mixplane.constructor.server import ConstructorServer
    from mixplane.control import write_ready

    spec = _component_spec(args)
    srv = ConstructorServer(spec, args.index, args.planner, host=args.host or spec.runtime.host, metrics_port=args.metrics_port,
                            ports=(args.data_port, args.client_port), advertise_host=args.advertise_host)
    _on_sigterm(srv)
    write_ready(args.ready_file, {"data_endpoint": srv.data_endpoint, "client_endpoint": srv.client_endpoint,
                                  "metrics_port": srv.metrics_port})
    srv.run()
    return 0


def cmd_loader(args: argparse.Namespace) -> int:
    # A loader is one of many processes on a node: tokenize on this thread (rayon's worker threads cost
    # ~30% more CPU per token here), unless the operator asked otherwise.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # allocator settings first, before the loader allocates anything (see mixplane.loader.memory)
    from mixplane.loader.memory import configure_allocator

    logging.getLogger("mixplane.loader").info("allocator: %s", configure_allocator())
    from mixplane.control import write_ready
    from mixplane.launch import loader_name
    from mixplane.loader.host import parse_members
    from mixplane.loader.host import LoaderHost

    spec = _component_spec(args)
    # every loader process is a host of partitions (loader.host): the planner's partition table decides what it
    # serves; the ones named here are opened at once and asked for (a shadow keeps them warm)
    if args.sources:
        members = parse_members(spec, args.sources)
    elif args.source:
        members = [(spec.source_index(args.source), args.replica)]
    elif args.host_name:
        members = []  # an empty host: it serves what the planner hands it (scaling)
    else:
        raise SystemExit("mixplane loader: give --source NAME [--replica R], --sources NAME[:R],... or --host-name NAME")
    name = args.host_name or loader_name([(spec.sources[si].name, r) for si, r in members])
    if args.shadow_of and not args.shadow:
        raise SystemExit("mixplane loader: --shadow-of HOST needs --shadow (it names the primary a shadow stands beside)")
    from mixplane.loader.hooks import LoaderHookError

    try:
        host = LoaderHost(spec, args.planner, name, partitions=members, shadow=args.shadow, shadow_of=args.shadow_of,
                          metrics=spec.runtime.metrics,
                          metrics_port=args.metrics_port, state_dir=args.state_dir)
    except LoaderHookError as e:  # hooks.loader that does not load: one line naming it, not a traceback
        logging.getLogger("mixplane.loader").error("%s", e)
        return 2
    _on_sigterm(host)
    if args.trainer_dir:
        _watch_pod_end(host, args)
    ready: dict[str, object] = {"host": name, "shadow": args.shadow,
                                "metrics_ports": {ld.name: host.metrics_port or ld.metrics_port for ld in host.loaders.values()}}
    if args.sources:
        ready["sources"] = args.sources
    elif args.source:
        ready.update(source=args.source, replica=args.replica, metrics_port=host.metrics_port or host.loaders[members[0]].metrics_port)
    write_ready(args.ready_file, ready)
    try:
        host.run()
    except LoaderHookError as e:  # hooks.loader gave a result that is no way to consume the plan: stop, named
        logging.getLogger("mixplane.loader").error("%s", e)
        return 2
    return host.exit_code


def _watch_pod_end(host: Any, args: argparse.Namespace) -> None:
    """A loader container of a trainer pod (sidecar placement): stop when the pod's trainer ranks ended
    (mixplane.podend), exit 0 after a clean end, non-zero when a trainer that nothing restarts failed."""
    import threading

    if not args.trainer_ranks:
        raise SystemExit("mixplane loader: --trainer-dir needs --trainer-ranks FIRST-LAST (the pod's trainer ranks)")
    try:
        watch = podend.PodEndWatch(podend.parse_ranks(args.trainer_ranks), args.trainer_restart,
                                   quiet_s=args.trainer_quiet_s, gone_s=args.trainer_gone_s)
    except ValueError as e:
        raise SystemExit(f"mixplane loader: {e}") from None
    log = logging.getLogger("mixplane.loader")

    def run() -> None:
        reported = dict(watch.crashes)
        while not host.stopped:
            now = time.monotonic()
            try:
                d = watch.poll(args.trainer_dir, now, host.quiet_for(now))
            except OSError as e:  # an unreadable directory must not end the loader: it serves on, and says why
                log.warning("%s: cannot read the trainer's marks in %s: %s", host.host_name, args.trainer_dir, e)
                d = None
            if watch.crashes != reported:
                log.warning("%s: trainer rank(s) ended without a clean close: %s (restartPolicy %s)", host.host_name,
                            ", ".join(f"rank {r} x{n}" for r, n in sorted(watch.crashes.items())), watch.restart_policy)
                reported = dict(watch.crashes)
            if d is not None:
                (log.info if d.code == 0 else log.error)("%s: %s: exiting %d", host.host_name, d.reason, d.code)
                host.exit_code = d.code
                host.stopped = True
                return
            time.sleep(0.5)

    threading.Thread(target=run, name="pod-end", daemon=True).start()


def format_progress(st: dict[str, Any], tok_rate: float) -> str:
    parts = [f"step {st['planned_through']:>6}", f"phase {st['phase']}", f"{tok_rate / 1e3:8.1f}k tok/s"]
    refused = sorted(st.get("refused_loaders") or {})  # loaders the run refused (their reason: `mixplane status`)
    if refused:  # before the shares: a terminal's line is cut at 200 characters
        parts.append("refused: " + ",".join(refused[:4]) + (f" +{len(refused) - 4}" if len(refused) > 4 else ""))
    for n, t, r in zip(st["sources"], st["target"], st["realized_phase"]):
        parts.append(f"{n} {100 * r:5.1f}% ({100 * t:.1f}%)")
    if st.get("waiting"):
        parts.append("waiting: " + ",".join(st["waiting"]))
    return " | ".join(parts)


def cmd_run(args: argparse.Namespace) -> int:
    from mixplane.runtime import EmbeddedRuntime

    spec = _load(args.file)
    from mixplane.runtime import RestartPolicy

    restarts = 0 if args.fail_fast else args.restarts
    policy = (RestartPolicy(budget=restarts, hang_after_s=args.hang_after, standby=not args.no_standby)
              if restarts > 0 else None)
    rt = EmbeddedRuntime(spec, args.run_dir, log_level=args.log_level, restart=policy)
    stop = {"flag": False}

    def on_signal(*_: object) -> None:
        stop["flag"] = True
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    rt.start()
    try:
        eps = rt.endpoints()
        print(f"mixplane: mixture {spec.name!r} running; run dir {eps['run_dir']}")
        print(f"  planner      {eps['planner']}   (export MIXPLANE_PLANNER={eps['planner']})")
        if rt.key_dir:
            print(f"  keys         {rt.key_dir}   (trainers: export MIXPLANE_CURVE_DIR={rt.key_dir}; "
                  f"mixplane status|update --run-dir {eps['run_dir']})")
        else:
            print("  security     open (runtime.security: open): any local process can control this run")
        for name, info in eps["components"].items():
            extra = " ".join(f"{k}={v}" for k, v in info.items() if k.endswith("endpoint") or k == "metrics_port")
            print(f"  {name:<28} pid {info['pid']:<7} {extra}")
        sys.stdout.flush()
        last_tok, last_t = 0, time.monotonic()
        t_end = None if args.max_seconds is None else time.monotonic() + args.max_seconds
        # supervision runs on its own thread: a restart never waits for this loop's status request (which
        # times out while the planner is down)
        restarted = {c.name: len(c.restarts) for c in rt.children}
        rt.supervise_in_background(SUPERVISE_EVERY_S)
        while not stop["flag"] and (t_end is None or time.monotonic() < t_end):
            time.sleep(1.0)
            if rt.failure is not None:
                print(f"mixplane: {rt.failure}", file=sys.stderr)
                return 1
            for c in list(rt.children):
                if len(c.restarts) > restarted.get(c.name, 0):
                    print(f"mixplane: restarted {c.name} (restart {len(c.restarts)})", file=sys.stderr)
                restarted[c.name] = len(c.restarts)
            try:
                st = rt.status(timeout_s=2.0)
            except (TimeoutError, RuntimeError) as e:
                print(f"mixplane: status: {e}", file=sys.stderr)
                continue
            now = time.monotonic()
            rate = (st["tokens_planned"] - last_tok) / max(now - last_t, 1e-9)
            last_tok, last_t = st["tokens_planned"], now
            line = format_progress(st, rate)
            if sys.stdout.isatty():
                print("\r" + line[:200], end="", flush=True)
            else:
                print(line, flush=True)
    finally:
        rt.stop()
        print("\nmixplane: stopped", flush=True)
    return 0


def _control_target(args: argparse.Namespace) -> tuple[str, Any]:
    """The planner endpoint and the admin keys of `mixplane status|update`: --planner or the run dir's
    endpoints.json; keys from --curve-dir, $MIXPLANE_CURVE_DIR or the run dir's keys/."""
    from mixplane.control import control_curve, planner_endpoint_of

    if not args.planner and not args.run_dir:
        raise SystemExit(f"mixplane {args.command}: give --planner ENDPOINT or --run-dir DIR (printed by `mixplane run`)")
    try:
        endpoint = args.planner or planner_endpoint_of(args.run_dir)
    except (OSError, ValueError) as e:
        raise SystemExit(f"mixplane {args.command}: {e}") from None
    return endpoint, control_curve(args.curve_dir, run_dir=args.run_dir)


def cmd_status(args: argparse.Namespace) -> int:
    from mixplane.control import status

    endpoint, curve = _control_target(args)
    try:
        print(json.dumps(status(endpoint, args.timeout, curve=curve), indent=1))
    except (TimeoutError, RuntimeError) as e:
        print(f"mixplane status: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_handoff(args: argparse.Namespace) -> int:
    """Move a partition to another loader process at a step boundary, or (without arguments) print the
    partition table (planner.partitions)."""
    from mixplane.control import handoff, partitions

    endpoint, curve = _control_target(args)
    try:
        if args.partition is None:
            out = partitions(endpoint, args.timeout, curve=curve)
        elif args.to is None:
            raise SystemExit("mixplane handoff: give the loader host to move the partition to (--to NAME)")
        else:
            out = handoff(endpoint, args.partition, args.to, args.timeout, curve=curve)
    except (TimeoutError, RuntimeError) as e:
        print(f"mixplane handoff: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=1))
    return 0


def cmd_repartition(args: argparse.Namespace) -> int:
    """Read a source with another number of partitions from a step boundary on (mixplane.repartition). The
    new partitions are served by the loader processes named with --hosts (one per partition), else partition k
    below the current count stays where it is and the others go to the live loader processes serving least (start
    empty ones first: `mixplane loader --spec S --planner EP --host-name NAME`)."""
    from mixplane.control import repartition

    if args.partitions is None:
        raise SystemExit("mixplane repartition: give the new number of partitions (--partitions M)")
    hosts = [h for h in (args.hosts or "").split(",") if h] or None
    endpoint, curve = _control_target(args)
    try:
        out = repartition(endpoint, args.source, args.partitions, args.timeout, step=args.step, hosts=hosts, curve=curve)
    except (TimeoutError, RuntimeError) as e:
        print(f"mixplane repartition: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=1))
    return 0


def update_message(weights: list[str], step: int | None, lr_scale: float | None = None,
                   temperature: float | None = None, update_id: str | None = None) -> dict[str, Any]:
    """The weights-form UPDATE_MIXTURE request of `mixplane update --weight`; bad input fails here, before
    reaching the planner. Without a step the planner takes the first step it has not planned."""
    import math

    parsed: dict[str, float] = {}
    for kv in weights:
        k, sep, v = kv.partition("=")
        try:
            w = float(v)
        except ValueError:
            w = math.nan
        if not sep or not k or not (math.isfinite(w) and w >= 0):
            raise ValueError(f"--weight {kv!r}: expected SOURCE=W with W a finite number >= 0")
        parsed[k] = w
    if step is not None and step < 0:
        raise ValueError(f"--step must be >= 0, got {step}")
    meta: dict[str, Any] = {"weights": parsed}
    if step is not None:
        meta["effective_step"] = step
    for name, x in (("lr_scale", lr_scale), ("temperature", temperature)):
        if x is None:
            continue
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {x}")
        meta[name] = x
    if update_id is not None:
        from mixplane.mixing import check_update_id

        meta["update_id"] = check_update_id(update_id)
    return meta


def mixture_update_message(path: str, update_id: str | None = None, step: int | None = None) -> dict[str, Any]:
    """The whole-mixture UPDATE_MIXTURE request of `mixplane update --mixture FILE` (the embedded equivalent of a
    `kubectl patch` of spec.mixture): FILE is a YAML or JSON mixture section, or a whole spec (a DataMixture
    resource too) whose `mixture` is taken. Built by mixing.mixture_update_meta, as the operator does; without
    an update id a new one is made (the same id sent again is acknowledged as a duplicate and changes nothing).
    A file that is no mixture raises SpecError naming the file and field; the planner checks the rest (sources
    named, temperature, phases) against the running spec."""
    import uuid

    from pydantic import ValidationError

    from mixplane.mixing import mixture_update_meta
    from mixplane.spec import MixtureSpec, Problem, SpecError, read_spec_document, unwrap_document

    doc = read_spec_document(path)
    if not isinstance(doc, dict):
        raise SpecError([Problem("<root>", f"expected a mapping (a mixture section or a spec), got {type(doc).__name__}")], path)
    where = ""
    mixture: Any = doc
    if "sources" in doc or ("spec" in doc and ("kind" in doc or "apiVersion" in doc)):
        raw, prefix = unwrap_document(doc)
        where = f"{prefix}.mixture" if prefix else "mixture"
        mixture = raw.get("mixture") or {}
    elif set(doc) == {"mixture"}:
        where, mixture = "mixture", doc["mixture"] or {}
    if not isinstance(mixture, dict):
        raise SpecError([Problem(where or "<root>", f"expected a mapping, got {type(mixture).__name__}")], path)
    try:
        m = MixtureSpec.model_validate(mixture)
    except ValidationError as e:
        raise SpecError([Problem(".".join([where] * bool(where) + [str(x) for x in err["loc"]]) or "<root>", err["msg"])
                         for err in e.errors()], path) from None
    if step is not None and step < 0:
        raise ValueError(f"--step must be >= 0, got {step}")
    return mixture_update_meta(m, update_id if update_id is not None else f"cli-{uuid.uuid4().hex}", step)


def cmd_update(args: argparse.Namespace) -> int:
    from mixplane.control import update_mixture
    from mixplane.spec import SpecError

    try:
        if args.mixture:
            if args.weight or args.lr_scale is not None or args.temperature is not None:
                raise ValueError("--mixture carries the whole mixture: give no --weight, --lr-scale or --temperature")
            meta = mixture_update_message(args.mixture, args.update_id, args.step)
        elif not args.weight and args.lr_scale is None and args.temperature is None:
            raise ValueError("nothing to update: give --mixture FILE, or --weight SOURCE=W / --lr-scale / --temperature")
        else:
            meta = update_message(args.weight, args.step, args.lr_scale, args.temperature, args.update_id)
    except SpecError as e:
        for p in e.problems:
            print(f"mixplane update: {e.origin}: {p}", file=sys.stderr)
        return EXIT_INVALID
    except ValueError as e:
        print(f"mixplane update: {e}", file=sys.stderr)
        return EXIT_INVALID
    endpoint, curve = _control_target(args)
    try:
        print(json.dumps(update_mixture(endpoint, meta, args.timeout, curve=curve)))
    except (TimeoutError, RuntimeError) as e:
        print(f"mixplane update: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_demo_data(args: argparse.Namespace) -> int:
    from mixplane.demo.data import build_demo_data

    summary = build_demo_data(Path(args.dir), max_mb=args.max_mb, vocab_size=args.vocab, images=args.images)
    print(json.dumps(summary, indent=1))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from mixplane.demo.train import run_demo

    return run_demo(Path(args.dir), steps=args.steps, ranks=args.ranks, quick=args.quick, max_mb=args.max_mb)


def cmd_replay(args: argparse.Namespace) -> int:
    from mixplane.replay import replay_step

    spec = _load(args.file)
    out = replay_step(spec, step=args.step, rank=args.rank, run_dir=args.run_dir, save=args.out, journal=args.journal)
    print(json.dumps(out, indent=1))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from mixplane.profile import error_message, profile_spec, termination_message

    names = [n for n in (args.sources or "").split(",") if n] or None
    log = Path(args.termination_log) if args.termination_log else None
    from mixplane.checks import default_checks
    from mixplane.spec import SpecError, load_spec

    try:
        spec = load_spec(args.file, checks=default_checks())
    except SpecError as e:  # e.g. a source no file of which can be read with the credentials given
        problems = [f"{e.origin}: {p}" for p in e.problems]
        print("\n".join(problems), file=sys.stderr)
        if log is not None:
            log.write_text(error_message("; ".join(problems), os.environ))
        return EXIT_INVALID
    try:
        out = profile_spec(spec, names, max_rows=args.max_rows, max_cpu_s=args.max_cpu_s,
                           **({"sample_files": args.sample_files} if args.sample_files is not None else {}))
        message = termination_message(out) if log is not None else None
    except Exception as e:  # noqa: BLE001 - in a profiling pod every failure must reach the operator, redacted
        text = f"{args.file}: {type(e).__name__}: {e}" if log is not None else f"{args.file}: {e}"
        print(text, file=sys.stderr)
        if log is not None:
            log.write_text(error_message(text, os.environ))
            return 1
        if isinstance(e, (ValueError, OSError)):
            return 1
        raise
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if log is not None and message is not None:
        log.write_text(message)
    print(text)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Time the model's kernels, fit the cost model's coefficients, print them and (--write) put them in the spec."""
    import yaml

    from mixplane.spec import SpecError, load_spec

    try:
        spec = load_spec(args.file)
    except SpecError as e:
        print("\n".join(f"{e.origin}: {p}" for p in e.problems), file=sys.stderr)
        return EXIT_INVALID
    try:
        from mixplane.calibrate import calibrate, with_calibration
    except ImportError as e:  # torch is the client's extra
        print(f"mixplane calibrate needs torch (pip install 'mixplane[torch]'): {e}", file=sys.stderr)
        return 1
    module = args.module or spec.topology.backbone()[0]
    if module not in spec.topology.modules:
        print(f"{args.file}: --module {module}: not a module of topology.modules ({', '.join(spec.topology.modules)})",
              file=sys.stderr)
        return EXIT_INVALID
    try:
        cal, report = calibrate(spec, module, device=args.device, max_hidden=args.max_hidden,
                                microbatch_count=args.microbatches, repeats=args.repeats)
    except (ValueError, RuntimeError) as e:
        print(f"{args.file}: calibration failed: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"calibration": cal.model_dump(mode="json"), "report": report}, indent=1))
    if args.write:
        doc = yaml.safe_load(Path(args.file).read_text())
        out = with_calibration(doc, module, cal)
        Path(args.write).write_text(yaml.safe_dump(out, sort_keys=False))
        print(f"wrote {args.write} (model.{module}.calibration)", file=sys.stderr)
    return 0


def cmd_prep(args: argparse.Namespace) -> int:
    """Offline stages on Spark: `dedup` (weighted MinHash, LSH, vertex cover) and `depsort` (dependency order)."""
    from mixplane.loader.iceberg import IcebergError

    try:
        from mixplane.prep import spark as prep
    except ImportError as e:
        print(f"mixplane prep needs pyspark and a JDK: {e}", file=sys.stderr)
        return 1
    sess = prep.session(master=args.master)
    try:
        df = sess.read.parquet(args.input)
        need = {"dedup": ["id", "text"] + (["repo", "fork", "stars"] if getattr(args, "repo_level", False) else []),
                "depsort": ["repo", "path", "text"]}[args.stage]
        missing = [c for c in need if c not in df.columns]
        if missing:
            print(f"{args.input}: column(s) {', '.join(missing)} missing (has {', '.join(df.columns)})", file=sys.stderr)
            return EXIT_INVALID
        if args.iceberg:
            from mixplane.prep import iceberg as prep_iceberg

            if args.stage == "dedup" and len(set(args.threshold)) > 1:
                print(f"--iceberg {args.iceberg}: one table takes one --threshold's output (got {len(set(args.threshold))})",
                      file=sys.stderr)
                return EXIT_INVALID
            prep_iceberg.check_target(args.iceberg, args.output)

        def published(out: str) -> dict[str, Any]:
            if not args.iceberg:
                return {}
            from mixplane.loader.files import list_source_files

            return {"iceberg": prep_iceberg.publish(args.iceberg, list_source_files(out).paths)}

        if args.stage == "depsort":
            prep.depsort(df).join(df, ["repo", "path"]).orderBy("repo", "order").write.mode("overwrite").parquet(args.output)
            print(json.dumps({"stage": "depsort", "output": args.output, **published(args.output)}))
            return 0
        opts = prep.DedupOptions(num_hashes=args.num_hashes, seed=args.seed, code=args.code)
        reports = []
        for th, (kept, report) in prep.dedup(df, sorted(set(args.threshold)), opts, repo_level=args.repo_level).items():
            out = args.output if len(args.threshold) == 1 else f"{args.output.rstrip('/')}/threshold={th}"
            kept.write.mode("overwrite").parquet(out)
            reports.append({**report, "output": out, **published(out)})
        print(json.dumps(reports))
        return 0
    except IcebergError as e:  # names the table
        print(f"mixplane prep: {e}", file=sys.stderr)
        return EXIT_INVALID
    except ValueError as e:
        print(f"{args.input}: {e}", file=sys.stderr)
        return EXIT_INVALID
    finally:
        sess.stop()


def cmd_operator(args: argparse.Namespace) -> int:
    try:
        from mixplane.operator.main import run_operator
    except ImportError as e:
        print(f"mixplane operator: not available ({e})", file=sys.stderr)
        return 1
    # the chart's liveness probe: kopf answers GET /healthz on MIXPLANE_HEALTH_PORT
    health = settings.get("MIXPLANE_HEALTH_PORT")
    return run_operator(namespace=args.namespace, liveness=f"http://0.0.0.0:{health}/healthz" if health else None)


def cmd_listing(args: argparse.Namespace) -> int:
    """One JSON line per source: its listing (kept, or listed now; --refresh: listed now and kept)."""
    from mixplane.loader.files import SourceFilesError
    from mixplane.loader.listing import listing_report
    from mixplane.spec import SpecError, load_spec

    try:
        spec = load_spec(args.file)
    except SpecError as e:
        for p in e.problems:
            print(f"{e.origin}: {p}", file=sys.stderr)
        return EXIT_INVALID
    sources = [s for s in spec.sources if not args.source or s.name in args.source]
    if args.source and len(sources) != len(set(args.source)):
        print(f"{args.file}: no source named {sorted(set(args.source) - {s.name for s in sources})}", file=sys.stderr)
        return EXIT_INVALID
    failed = 0
    for s in sources:
        try:
            print(json.dumps(listing_report(s, refresh=args.refresh)), flush=True)
        except SourceFilesError as e:
            print(f"{args.file}: source {s.name!r}: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def cmd_crd(args: argparse.Namespace) -> int:
    from mixplane.operator.crd import crd_yaml

    text = crd_yaml()
    if not args.out:
        sys.stdout.write(text)
    for out in args.out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    return 0


def constructor_index(value: str) -> int:
    """`--index 3`, or `--index $(POD_NAME)` in a StatefulSet pod (`mix-constructor-3` -> 3)."""
    import re

    m = re.fullmatch(r"(?:.*-)?(\d+)", value)
    if not m:
        raise argparse.ArgumentTypeError(f"expected an index or a StatefulSet pod name ending in -N, got {value!r}")
    return int(m.group(1))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mixplane", description="Disaggregated multisource data plane for foundation-model training.")
    p.add_argument("--log-level", default="WARNING")
    sub = p.add_subparsers(dest="command", required=True)

    v = sub.add_parser("validate", help="check DataMixture files; exit 2 with one line per problem")
    v.add_argument("files", nargs="+")
    v.add_argument("--no-files", action="store_true", help="do not look at data files and tokenizers")
    v.add_argument("-q", "--quiet", action="store_true")
    v.set_defaults(fn=cmd_validate)

    d = sub.add_parser("demo-data", help="build the demo sources (Parquet) and tokenizer from local text")
    d.add_argument("dir")
    d.add_argument("--max-mb", type=float, default=24.0, help="text per source, in MB")
    d.add_argument("--vocab", type=int, default=8192)
    d.add_argument("--images", action="store_true", help="also build `pairs`: local images with captions (image_text, for the VLM example)")
    d.set_defaults(fn=cmd_demo_data)

    r = sub.add_parser("run", help="run a mixture with the embedded runtime")
    r.add_argument("file")
    r.add_argument("--run-dir")
    r.add_argument("--max-seconds", type=float)
    r.add_argument("--restarts", type=int, default=DEFAULT_RESTARTS,
                   help="restart a component (planner, constructor or loader) that died, at most N times in 5 minutes "
                        f"each, with backoff (default {DEFAULT_RESTARTS}; 0 or --fail-fast: a dead component stops the run)")
    r.add_argument("--fail-fast", action="store_true", help="stop the run at the first component that exits (no restarts)")
    r.add_argument("--hang-after", type=float, default=None, metavar="S",
                   help="with --restarts: a component silent for S seconds (hung, e.g. SIGSTOP) is killed and restarted")
    r.add_argument("--no-standby", action="store_true",
                   help="with --restarts: keep no warm standby processes (a restart then starts a new interpreter: "
                        "1-4 s longer on a loaded machine; two idle processes, ~170 MB each, less while nothing fails)")
    r.set_defaults(fn=cmd_run)

    dm = sub.add_parser("demo", help="train a small GPT on 2 ranks fed by mixplane")
    dm.add_argument("--dir", default=".mixplane/demo-data")
    dm.add_argument("--steps", type=int, default=200)
    dm.add_argument("--ranks", type=int, default=2)
    dm.add_argument("--quick", action="store_true")
    dm.add_argument("--max-mb", type=float, help="demo text per source in MB (default 24, --quick 6); rebuilt when it changes")
    dm.set_defaults(fn=cmd_demo)

    rp = sub.add_parser("replay", help="rebuild the batch one rank got at one step")
    rp.add_argument("file")
    rp.add_argument("--step", type=int, required=True)
    rp.add_argument("--rank", type=int, required=True)
    rp.add_argument("--run-dir")
    rp.add_argument("--out", help="save the batch as .npz")
    rp.add_argument("--journal", help="replay from this journal (e.g. an earlier run's, kept in RUN_DIR/journals/)")
    rp.set_defaults(fn=cmd_replay)

    st = sub.add_parser("status", help="progress of a running mixture")
    st.add_argument("--planner", help="planner endpoint (default: from --run-dir)")
    st.add_argument("--timeout", type=float, default=5.0)
    st.set_defaults(fn=cmd_status)

    up = sub.add_parser("update", help="adopt a whole mixture section from a step on (--mixture FILE: weights, temperature, "
                        "phases, anneal), or change weights until the next scheduled phase (--weight)")
    up.add_argument("--planner", help="planner endpoint (default: from --run-dir)")
    up.add_argument("--step", type=int, help="first step of the change (default: the first step the planner has not planned)")
    up.add_argument("--mixture", metavar="FILE", help="YAML/JSON mixture section, or a spec whose `mixture` is taken: "
                    "the planner adopts it whole from --step on (a new generation; later phases at their steps)")
    up.add_argument("--update-id", help="idempotency key: an id the planner acknowledged before is answered again "
                    "(duplicate) and changes nothing (default with --mixture: a new id)")
    up.add_argument("--weight", action="append", default=[], metavar="SOURCE=W")
    up.add_argument("--lr-scale", type=float, help="learning-rate multiplier from --step on (finite, > 0)")
    up.add_argument("--temperature", type=float, help="mixture temperature from --step on (finite, > 0)")
    up.add_argument("--timeout", type=float, default=5.0)
    up.set_defaults(fn=cmd_update)
    ho = sub.add_parser("handoff", help="move a partition (SOURCE:REPLICA) to another loader process at a step "
                        "boundary; without arguments, print which process serves (and shadows) each partition")
    ho.add_argument("partition", nargs="?", help="SOURCE:REPLICA, e.g. web:0")
    ho.add_argument("--to", help="the loader host (process) name that takes it, as `mixplane handoff` lists them")
    ho.add_argument("--planner", help="planner endpoint (default: from --run-dir)")
    ho.add_argument("--timeout", type=float, default=5.0)
    ho.set_defaults(fn=cmd_handoff)
    rp = sub.add_parser("repartition", help="read a source with another number of partitions from a step boundary "
                        "on (the new partitions share the unread rest of the epoch; nothing is read twice or skipped)")
    rp.add_argument("source", help="the source's name")
    rp.add_argument("--partitions", type=int, help="the new number of partitions (1..1024)")
    rp.add_argument("--step", type=int, help="the step it applies from (default: the first step not planned)")
    rp.add_argument("--hosts", help="comma-separated loader host names, one per new partition")
    rp.add_argument("--planner", help="planner endpoint (default: from --run-dir)")
    rp.add_argument("--timeout", type=float, default=5.0)
    rp.set_defaults(fn=cmd_repartition)
    for c in (st, up, ho, rp):  # a secured run (the default) answers only its admin key
        c.add_argument("--run-dir", help="the run's directory: planner endpoint and keys (printed by `mixplane run`)")
        c.add_argument("--curve-dir", help="key directory of a secured run (default: $MIXPLANE_CURVE_DIR, else RUN_DIR/keys)")

    pf = sub.add_parser("profile", help="measure each source's loader cost: CPU s/token and memory per partition (JSON)")
    pf.add_argument("file")
    pf.add_argument("--max-rows", type=int, default=2048, help="rows read per source")
    pf.add_argument("--max-cpu-s", type=float, default=1.0, help="CPU seconds spent per source at most")
    pf.add_argument("--sample-files", type=int, default=None,
                    help="files of a source whose footers and pages are read at most (default 64; a larger source is "
                         "profiled on a sample, max_partitions extrapolated to its listing)")
    pf.add_argument("--out", help="also write the JSON here")
    pf.add_argument("--sources", help="only these sources (comma-separated names)")
    pf.add_argument("--termination-log", metavar="PATH",
                    help="write the result for the operator (compact, <= 4096 bytes: a pod's termination message), "
                         "or the error with credential-like environment values redacted")
    pf.set_defaults(fn=cmd_profile)

    ca = sub.add_parser("calibrate", help="time the model's kernels with torch and fit the cost model's seconds per FLOP "
                                          "(model.<module>.calibration)")
    ca.add_argument("file")
    ca.add_argument("--module", help="the module to calibrate (default: the backbone)")
    ca.add_argument("--device", default="cpu", help="torch device: cpu (default) or cuda[:N]")
    ca.add_argument("--max-hidden", type=int, default=256,
                    help="on a CPU, time a layer of at most this hidden size (hidden, heads and MLP shrunk by one factor)")
    ca.add_argument("--microbatches", type=int, default=16, help="packed microbatches timed")
    ca.add_argument("--repeats", type=int, default=3, help="runs per microbatch (the fastest counts)")
    ca.add_argument("--write", metavar="FILE", help="write the spec with the calibration set to FILE")
    ca.set_defaults(fn=cmd_calibrate)

    pr = sub.add_parser("prep", help="offline stages on Spark that write Parquet for the loaders: dedup, depsort")
    prs = pr.add_subparsers(dest="stage", required=True)
    dd = prs.add_parser("dedup", help="near-duplicate removal: weighted MinHash, LSH, connected components, vertex cover")
    dd.add_argument("input", help="Parquet with columns id, text (and repo, fork, stars for --repo-level)")
    dd.add_argument("output", help="Parquet directory of the kept rows (one per threshold under it when several)")
    dd.add_argument("--threshold", type=float, action="append", required=True,
                    help="weighted Jaccard similarity at which documents are near-duplicates (repeatable)")
    dd.add_argument("--repo-level", action="store_true", help="keep or drop whole repositories (originals over forks)")
    dd.add_argument("--code", action="store_true", help="code tokens (identifiers, numbers, punctuation) instead of words")
    dd.add_argument("--num-hashes", type=int, default=128)
    dd.add_argument("--seed", type=int, default=1)
    dd.add_argument("--master", default="local[*]", help="Spark master (local[*], spark://..., k8s://...)")
    dd.add_argument("--iceberg", metavar="URI", help="also register the output as the next snapshot of this Iceberg "
                    "table (iceberg://<catalog>/<namespace>.<table>; created when absent, its rows replaced when not)")
    dd.set_defaults(fn=cmd_prep)
    ds = prs.add_parser("depsort", help="each repository's files in dependency order (Python and JavaScript syntax trees)")
    ds.add_argument("input", help="Parquet with columns repo, path, text")
    ds.add_argument("output", help="Parquet directory: the rows with their `order`, sorted by repo and order")
    ds.add_argument("--master", default="local[*]")
    ds.add_argument("--iceberg", metavar="URI", help="also register the output as the next snapshot of this Iceberg table")
    ds.set_defaults(fn=cmd_prep)

    op = sub.add_parser("operator", help="run the Kubernetes operator")
    op.add_argument("--namespace")
    op.set_defaults(fn=cmd_operator)

    ls = sub.add_parser("listing", help="each source's listing (JSON lines: files, digest, age, where it was kept); "
                                        "--refresh lists the stores again so the next start reads new files")
    ls.add_argument("file")
    ls.add_argument("--refresh", action="store_true", help="list the stores now and keep the listings (the next "
                    "start reads the files they name, new ones included)")
    ls.add_argument("--source", action="append", default=[], metavar="NAME", help="only this source (repeatable)")
    ls.set_defaults(fn=cmd_listing)

    cr = sub.add_parser("crd", help="print the DataMixture CustomResourceDefinition (generated from the spec model)")
    cr.add_argument("--out", action="append", default=[], metavar="FILE", help="write it to FILE instead (repeatable)")
    cr.set_defaults(fn=cmd_crd)

    for name, fn in (("planner", cmd_planner), ("constructor", cmd_constructor), ("loader", cmd_loader)):
        c = sub.add_parser(name, help=f"run one {name} (used by the runtime and by pods)")
        c.add_argument("--spec", required=True, help="resolved spec (JSON) written by the runtime or the operator")
        c.add_argument("--ready-file")
        c.add_argument("--curve-dir", help="CURVE key directory (role key pairs); overrides the spec's runtime.curve")
        c.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: a free one)")
        if name == "planner":
            c.add_argument("--bind", default="tcp://127.0.0.1:*")
            c.add_argument("--run-dir")
        else:
            c.add_argument("--planner", required=True)
        if name == "constructor":
            c.add_argument("--index", type=constructor_index, required=True,
                           help="constructor index, or a StatefulSet pod name whose ordinal is the index (NAME-3 -> 3)")
            c.add_argument("--host", help="interface to bind (default: the spec's runtime.host)")
            c.add_argument("--data-port", type=int, default=0, help="port of the loaders' data socket (0: a free one)")
            c.add_argument("--client-port", type=int, default=0, help="port of the trainer clients' socket (0: a free one)")
            c.add_argument("--advertise-host", help="address announced to peers instead of the bound one (a pod IP)")
        if name == "loader":
            c.add_argument("--source")
            c.add_argument("--replica", type=int, default=0)
            c.add_argument("--sources", help="host several: NAME[:REPLICA],... (source grouping)")
            c.add_argument("--host-name", help="this loader process's name in the planner's partition table (default: "
                           "from its partitions, as the launch plan names it); alone: an empty host for handoffs")
            c.add_argument("--state-dir", help="where differential checkpoints go (runtime.loader_snapshot_every)")
            c.add_argument("--shadow", action="store_true", help="a shadow: keep the partitions warm, serve them only "
                           "when the planner promotes this host (runtime.shadow_loaders)")
            c.add_argument("--shadow-of", metavar="HOST", help="with --shadow: the primary loader host this shadow is "
                           "launched beside; it also stands by for the partitions that host is handed later (a "
                           "re-partition's new partition, a handoff), not only those named here")
            c.add_argument("--trainer-dir", help="a loader container of a trainer pod: the directory shared with its "
                           "trainer (mixplane.podend); the loader ends when the pod's trainer ranks did")
            c.add_argument("--trainer-ranks", help="with --trainer-dir: the pod's trainer ranks, FIRST-LAST")
            c.add_argument("--trainer-restart", default="Always", choices=("Always", "OnFailure", "Never"),
                           help="with --trainer-dir: the pod's restartPolicy (Never: a trainer that failed is not "
                           "restarted in the pod, and the loader then fails too)")
            c.add_argument("--trainer-quiet-s", type=float, default=podend.QUIET_S, help="with --trainer-dir: after "
                           "the pod's ranks ended cleanly, exit once nothing was asked or left to send for this long")
            c.add_argument("--trainer-gone-s", type=float, default=podend.GONE_S, help="with --trainer-dir and "
                           "--trainer-restart Never: fail once no rank of the pod has run for this long, not all clean")
        c.set_defaults(fn=fn)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    prof_dir = settings.get("MIXPLANE_PROFILE_DIR")
    if prof_dir and args.command in ("planner", "loader", "constructor"):
        # profile a component (cProfile stats land in MIXPLANE_PROFILE_DIR/<component>-<pid>.prof)
        import cProfile

        os.makedirs(prof_dir, exist_ok=True)
        prof = cProfile.Profile()
        try:
            return int(prof.runcall(args.fn, args) or 0)
        finally:
            prof.dump_stats(os.path.join(prof_dir, f"{args.command}-{os.getpid()}.prof"))
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
