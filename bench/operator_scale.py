"""The operator on sources of 1k / 10k / 100k files: what a DataMixture of two such sources costs the operator and
what it writes, against a real kube-apiserver + etcd + controller manager (tests/k8s/cluster.py).

For each file count (the corpus of bench/startup.py: half the files in source ``a``, half in ``b``, cached), in a
namespace of its own: `mixplane operator` as a child process; the DataMixture applied; the operator profiles the
sources in-process (a sample of files, see docs/operator.md) and applies its children. Then the pod templates it
wrote are run as local processes (tests/k8s/helpers.LocalPods: there is no kubelet in this tier) and a trainer
of two ranks reads batches.

Per row:
* ``apply_to_children_s``: from the apply to the status with every child applied (profile + partitioning);
* ``operator_cpu_s`` / ``operator_rss_mb``: the operator process's CPU seconds and peak RSS by then;
* ``status_bytes``: the DataMixture's status as JSON; ``configmap_bytes``: every ConfigMap the operator wrote, summed;
  ``object_bytes``: the whole DataMixture object;
* ``max_partitions``: the profiles' partition bounds summed (extrapolated from the sample to the listing);
  ``measured_by``: where the profiles come from (``operator``: in-process);
* ``loader_pods`` / ``partitions``: the loader Deployments with replicas and the partitions they hold;
* ``first_batch_s``: from starting the pods to both trainer ranks' first batch (cold: the loaders' page indexes
  start empty); ``loader_rss_mb``: the largest loader process RSS then.
``exponents``: least-squares slope of log(metric) over log(files) (0: independent of the file count).

    python bench/operator_scale.py [--files 1000,10000,100000] [--quick]
``--quick``: 1,000 and 3,000 files. Last line: one JSON object {"rows": [...], "exponents": {...}, "load": "<uptime>"}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT), str(ROOT / "bench")]
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p])

from startup import ensure_corpus, fit_exponent  # noqa: E402 - bench/startup.py's corpus, beside this script


def mixture(ns: str, root: Path) -> dict:
    return {
        "apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
        "metadata": {"name": "demo", "namespace": ns, "annotations": {"mixplane.io/tokens-per-second": "30000"}},
        "spec": {
            "sources": [{"name": n, "uri": str(root / n), "kind": "tokens", "columns": ["ids"]} for n in ("a", "b")],
            "mixture": {"weights": {"a": 0.6, "b": 0.4}, "seed": 1},
            "batch": {"sequences": 4, "seq_len": 256, "pad_id": 0},
            "topology": {"modules": {"backbone": {"dp": 2}}, "ranks_per_node": 1},
            "runtime": {"constructors": "per_node", "window": 8},
            "kubernetes": {"journal_mb": 0},
        },
    }


def measure(cluster, n: int, workdir: Path, steps: int) -> dict:
    import psutil

    from tests.k8s.helpers import LocalPods, applied, apply, get, operator, run_trainers, status_of, trainer_keys

    root = ensure_corpus(n)
    ns = f"scale-{n}-{os.getpid() % 10000}"
    cluster.kubectl("create", "namespace", ns)
    pods_dir = workdir / ns
    pods_dir.mkdir()
    pods = LocalPods(cluster, ns, pods_dir)
    row: dict = {"files": n}
    try:
        with operator(cluster, ns, MIXPLANE_OPERATOR_PLANNER=f"tcp://127.0.0.1:{pods.planner_port}") as op:
            proc = psutil.Process(op.pid)
            t0 = time.perf_counter()
            apply(cluster, mixture(ns, root))
            kids = applied(cluster, ns, timeout=1800.0)
            row["apply_to_children_s"] = round(time.perf_counter() - t0, 2)
            cpu = proc.cpu_times()
            row["operator_cpu_s"] = round(cpu.user + cpu.system, 2)
            status = (fetched := get(cluster, "datamixture", "demo", "-n", ns)).get("status") or {}
            row["status_bytes"] = len(json.dumps(status, separators=(",", ":")))
            row["object_bytes"] = len(json.dumps(fetched, separators=(",", ":")))
            cms = [c for c in get(cluster, "configmaps", "-n", ns)["items"] if c["metadata"]["name"].startswith("demo")]
            row["configmap_bytes"] = sum(len(json.dumps(c.get("data") or {}, separators=(",", ":"))) for c in cms)
            profs = [s.get("profile") or {} for s in status.get("sources") or []]
            row["max_partitions"] = sum(int(p.get("maxPartitions") or 0) for p in profs) or None
            row["measured_by"] = sorted({str(p.get("measuredBy")) for p in profs})
            loaders = [o for (kind, _), o in kids.items() if kind == "Deployment"
                       and o["metadata"]["labels"]["mixplane.io/role"] == "loader" and o["spec"]["replicas"]]
            row["loader_pods"] = len(loaders)
            row["partitions"] = sum(len(o["metadata"]["annotations"]["mixplane.io/partitions"].split(",")) for o in loaders)
            t1 = time.perf_counter()
            pods.start_mixture(kids, f"demo-planner.{ns}.svc:7000")
            firsts: list[float] = []

            def keep(batch) -> int:
                if not firsts or len(firsts) < 2 and int(batch["step"]) == 0:
                    firsts.append(time.perf_counter() - t1)
                return int(batch["step"])

            try:
                got = run_trainers(f"tcp://127.0.0.1:{pods.planner_port}", trainer_keys(cluster, ns, workdir / f"{ns}-keys"),
                                   2, steps, timeout=1800.0, keep=keep)
            except AssertionError as e:
                raise SystemExit(f"trainers failed at {n} files: {e}; dead pods: {pods.dead()}\n{pods.logs()[-6000:]}") from None
            assert got[0] == got[1] == list(range(steps)), got
            row["first_batch_s"] = round(max(firsts), 2)
            row["loader_rss_mb"] = round(max(psutil.Process(p.pid).memory_info().rss for name, p in pods.procs
                                             if "loader" in name and p.poll() is None) / 2**20, 1)
            row["operator_rss_mb"] = round(proc.memory_info().rss / 2**20, 1)
            row["phase"] = status_of(cluster, ns).get("phase")
    finally:
        pods.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--files", default="1000,10000,100000")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    sizes = [1000, 3000] if args.quick else [int(x) for x in args.files.split(",")]

    from mixplane.operator.crd import CRD_NAME
    from tests.k8s.cluster import Cluster
    from tests.k8s.helpers import CRD

    rows = []
    with tempfile.TemporaryDirectory(prefix="mixplane-opscale-") as tmp:
        work = Path(tmp)
        cluster = Cluster.start(work / "k8s")
        try:
            cluster.kubectl("apply", "-f", str(CRD))
            deadline = time.monotonic() + 60
            while cluster.kubectl("get", f"crd/{CRD_NAME}", "-o", 'jsonpath={.status.conditions[?(@.type=="Established")].status}',
                                  check=False).stdout.strip() != "True":
                if time.monotonic() > deadline:
                    raise SystemExit("the DataMixture CRD was not Established within 60 s")
                time.sleep(0.2)
            for n in sizes:
                row = measure(cluster, n, work, args.steps)
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            cluster.stop()
    xs = [float(r["files"]) for r in rows]
    exps = {k: fit_exponent(xs, [float(r[k]) for r in rows])
            for k in ("apply_to_children_s", "operator_cpu_s", "status_bytes", "configmap_bytes", "first_batch_s", "loader_rss_mb")
            if len(rows) > 1 and all(isinstance(r.get(k), (int, float)) and r[k] > 0 for r in rows)}
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"rows": rows, "exponents": {k: (round(v, 3) if v is not None and math.isfinite(v) else None)
                                                  for k, v in exps.items()}, "load": load}))


if __name__ == "__main__":
    main()
