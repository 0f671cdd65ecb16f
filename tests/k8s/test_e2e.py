"""End to end on the real node, as a user would: `helm install` the chart with the image built here, `kubectl
apply` a DataMixture reading an S3 bucket (moto on the docker bridge, the keys in a Secret), two trainer Jobs of
the trainer image (the webhook injects the planner endpoint and each pod's rank-bound key) train N steps and print
per-step digests that equal an embedded `mixplane run` of the same spec, step for step and rank for rank;
`kubectl get dmix` shows phase, step and realised weights; Debian's Prometheus scrapes the components through their
pods' prometheus.io annotations and every dashboard query answers; `kubectl delete datamixture` leaves nothing behind.

Kubernetes 1.20 has no Indexed Jobs (completionMode came in 1.21): each trainer slot is a Job of its own whose pod
carries `mixplane.io/trainer-index` (the webhook's first way to a slot). The planner journal's claim binds to a
hostPath PersistentVolume the test creates (a bare cluster has no provisioner). The pods' CPU requests are scaled
to a tenth by a test webhook (tests/k8s/shrink.py): sized for real nodes, they would not fit the test node's 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import urllib.parse
import urllib.request
from contextlib import contextmanager

import helm_python as helm
import pytest
import yaml

from mixplane.control import KEYS_SUBDIR
from tests.conftest import write_token_source
from tests.k8s import node as nodemod
from mixplane.operator.dashboard import PANELS
from tests.k8s.cluster import Cluster, binaries, free_port
from tests.k8s.e2e_trainer import digest
from tests.k8s.helpers import run_trainers, wait_for
from mixplane.operator.builders import SIDECAR_PREFIX
from tests.k8s.shrink import LABEL as SHRINK_LABEL
from tests.k8s.shrink import shrink_cpu

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "mixplane"
TRAINER = Path(__file__).with_name("e2e_trainer.py")
STEPS = 12
WORLD = 2
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module", autouse=True)
def small_cpu_requests(k8s_node: Cluster) -> Iterator[None]:
    """The operator asks a core for the planner and each constructor: a tenth of that fits the 2-core test node."""
    with shrink_cpu(k8s_node, 0.1):
        yield


@pytest.fixture(scope="module")
def bucket(k8s_node: Cluster, tmp_path_factory) -> Iterator[tuple[str, dict[str, str]]]:
    """moto's S3 server on the docker bridge (pods reach it; nothing else is needed) with two token sources."""
    import logging

    from moto.server import ThreadedMotoServer

    from tests.s3server import ACCESS_KEY, SECRET_KEY, REGION

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address=nodemod.BRIDGE_IP, port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    root = tmp_path_factory.mktemp("e2e-sources")
    write_token_source(root / "a", rows=1200, files=2, mean_len=60, seed=1)
    write_token_source(root / "b", rows=800, files=2, mean_len=150, seed=2)
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(access_key=ACCESS_KEY, secret_key=SECRET_KEY, region=REGION, scheme="http",
                           endpoint_override=f"{host}:{port}", allow_bucket_creation=True)
    fs.create_dir("corpus")
    for src in ("a", "b"):
        for f in sorted((root / src).iterdir()):
            with fs.open_output_stream(f"corpus/{src}/{f.name}") as out:
                out.write(f.read_bytes())
    creds = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION,
             "AWS_EC2_METADATA_DISABLED": "true"}
    try:
        yield endpoint, creds
    finally:
        server.stop()


def spec(endpoint: str, placement: str) -> dict:
    return {
        "sources": [{"name": n, "uri": f"s3://corpus/{n}/*.parquet", "endpoint": endpoint, "region": "us-east-1",
                     "kind": "tokens", "columns": ["tokens"], "shuffle": "rowgroup"} for n in ("a", "b")],
        "mixture": {"weights": {"a": 0.6, "b": 0.4}, "seed": 11},
        "batch": {"sequences": 4, "seq_len": 128, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": WORLD}}, "ranks_per_node": 1},
        "strategy": {"name": "vanilla"},
        "runtime": {"window": 16, "constructors": "per_node", "metrics": True},
        "kubernetes": {"placement": placement, "source_secret": "s3-creds", "journal_mb": 64, "trainer_pods": WORLD,
                       "sidecar_cpu": 0.5, "sidecar_memory_mb": 512},
    }


def kget(c: Cluster, *args: str) -> dict:
    return json.loads(c.kubectl("get", *args, "-o", "json").stdout)


def install_chart(c: Cluster, ns: str) -> helm.Config:
    cfg = helm.Config(kubeconfig_path=str(c.kubeconfig), namespace=ns)
    repo, tag = c.image.split(":")
    # (1.20 sets no kubernetes.io/metadata.name label); shrink: the test node's 2 cores (tests/k8s/shrink.py)
    c.kubectl("label", "namespace", ns, "mixplane-e2e=yes", f"{SHRINK_LABEL}=yes")
    cfg.install(str(CHART), "mixplane", {"image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
                                         "webhook": {"namespaceSelector": {"matchLabels": {"mixplane-e2e": "yes"}}}},
                namespace=ns, timeout=180)
    c.kubectl("-n", ns, "wait", "--for=condition=Available", "deployment", "--all", "--timeout=180s", timeout=200)
    return cfg


def journal_volume(c: Cluster, ns: str) -> str:
    """A hostPath PersistentVolume the journal's claim can bind (no class: the claim asks none, no default class)."""
    d = c.workdir / "pv" / ns
    d.mkdir(parents=True, exist_ok=True)
    os.chown(d, 10001, 10001)
    name = f"journal-{ns}"[:63]
    c.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "persistentVolumeReclaimPolicy": "Retain",
                 "claimRef": {"namespace": ns, "name": "demo-journal"}, "hostPath": {"path": str(d), "type": "Directory"}}}))
    return name


def trainer_job(ns: str, rank: int, image: str, steps: int = STEPS, step_s: float = 0.0, checkpoint: str | None = None) -> dict:
    """Trainer slot `rank` as a Job. `checkpoint`: a host directory (hostPath) for its checkpoints and digest lines
    (tests/k8s/e2e_trainer.py); the Job then starts a lost pod again (backoffLimit 3), which resumes from it."""
    env = [{"name": "TRAINER_RANK", "value": str(rank)}, {"name": "WORLD_SIZE", "value": str(WORLD)},
           {"name": "STEPS", "value": str(steps)}, {"name": "STEP_SECONDS", "value": str(step_s)},
           {"name": "MIXPLANE_TIMEOUT_S", "value": "120"}]
    mounts = [{"name": "trainer", "mountPath": "/trainer"}, {"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict] = [{"name": "trainer", "configMap": {"name": "trainer"}}, {"name": "tmp", "emptyDir": {}}]
    if checkpoint:
        env.append({"name": "CHECKPOINT_DIR", "value": "/checkpoint"})
        mounts.append({"name": "checkpoint", "mountPath": "/checkpoint"})
        volumes.append({"name": "checkpoint", "hostPath": {"path": checkpoint, "type": "Directory"}})
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"train-{rank}", "namespace": ns},
            "spec": {"backoffLimit": 3 if checkpoint else 0, "template": {
                "metadata": {"labels": {"mixplane.io/mixture": "demo", "mixplane.io/trainer-index": str(rank)}},
                "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False, "enableServiceLinks": False,
                         # the injected key files are a Secret volume of mode 0400: a non-root trainer reads them
                         # through its fsGroup (the kubelet gives the group read access)
                         "securityContext": {"fsGroup": 10001},
                         "containers": [{"name": "train", "image": image, "imagePullPolicy": "Never",
                                         "command": ["python", "/trainer/e2e_trainer.py"], "env": env,
                                         "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "readOnlyRootFilesystem": True,
                                                             "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                                         "volumeMounts": mounts}],
                         "volumes": volumes}}}}


def annotated_targets(c: Cluster, ns: str) -> list[dict]:
    """file_sd targets of the namespace's running pods whose prometheus.io annotations ask to be scraped, and of the
    loader containers the pod webhook put into trainer pods (sidecar placement): the trainer pod's annotations are
    its owner's, so each sidecar serves its metrics on a container port named `mx-metrics-<i>` (what a PodMonitor
    or a kubernetes_sd pod job keeping those port names finds)."""
    out = []
    for pod in kget(c, "pods", "-n", ns)["items"]:
        ann = pod["metadata"].get("annotations") or {}
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or pod["status"].get("phase") != "Running":
            continue
        name = pod["metadata"]["name"]
        if ann.get("prometheus.io/scrape") == "true":
            out.append({"targets": [f"{ip}:{ann['prometheus.io/port']}"],
                        "labels": {"pod": name, "__metrics_path__": ann.get("prometheus.io/path", "/metrics")}})
        out += [{"targets": [f"{ip}:{p['containerPort']}"], "labels": {"pod": f"{name}/{x['name']}", "__metrics_path__": "/metrics"}}
                for x in pod["spec"]["containers"] for p in x.get("ports") or [] if p.get("name", "").startswith("mx-metrics-")]
    return out


@contextmanager
def prometheus(c: Cluster, ns: str, tmp: Path) -> Iterator[str]:
    """Debian's Prometheus on the host scraping the pods whose prometheus.io annotations ask for it (the operator's
    components). Debian builds it without kubernetes_sd, so the test discovers them: the pods' annotations, read from
    the API server, become a file_sd target file (what kubernetes_sd + the usual relabelling give); yields its URL."""
    (tmp / "targets.json").write_text(json.dumps(annotated_targets(c, ns)))
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "scrape_configs": [{"job_name": "mixplane-pods",
                               "file_sd_configs": [{"files": [str(tmp / "targets.json")], "refresh_interval": "1s"}]}]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - the child writes it until the end
    proc = subprocess.Popen([binaries(("prometheus",))["prometheus"], f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


def prom_query(base: str, expr: str, at: float | None = None) -> list[dict]:
    """An instant query, evaluated now or at unix time `at`."""
    q = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
    with urllib.request.urlopen(f"{base}/api/v1/query?" + urllib.parse.urlencode(q), timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def reference(endpoint: str, creds: dict[str, str], placement: str, tmp: Path, steps: int = STEPS,
              update: tuple[dict, int] | None = None) -> dict[tuple[int, int], str]:
    """The same spec through the embedded runtime (`mixplane run`), two MixtureLoader ranks: (step, rank) -> digest.
    `update`: (mixture section, step) given to `mixplane update --mixture --step` before the trainers start."""
    doc = {"name": "demo", **{k: v for k, v in spec(endpoint, placement).items() if k != "kubernetes"}}
    f = tmp / "mixture.yaml"
    f.write_text(yaml.safe_dump(doc))
    env = {**os.environ, **creds, "PYTHONPATH": str(REPO / "src")}
    run = subprocess.Popen([sys.executable, "-m", "mixplane.cli", "run", str(f), "--run-dir", str(tmp / "run"),
                            "--max-seconds", "300"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        planner = None
        lines = []
        deadline = time.monotonic() + 120
        while planner is None and time.monotonic() < deadline:
            line = run.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "export MIXPLANE_PLANNER=" in line:
                planner = line.split("export MIXPLANE_PLANNER=", 1)[1].split(")")[0].strip()
        assert planner, "".join(lines)[-3000:]
        import threading

        threading.Thread(target=lambda: [None for _ in run.stdout], daemon=True).start()
        if update is not None:
            (tmp / "update.yaml").write_text(yaml.safe_dump(update[0]))
            r = subprocess.run([sys.executable, "-m", "mixplane.cli", "update", "--run-dir", str(tmp / "run"), "--mixture",
                                str(tmp / "update.yaml"), "--step", str(update[1])], capture_output=True, text=True, env=env,
                               timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr
        got = run_trainers(planner, tmp / "run" / KEYS_SUBDIR, WORLD, steps, timeout=240,
                           keep=lambda b: (int(b["step"]), digest(b)))
    finally:
        run.terminate()
        try:
            run.wait(30)
        except subprocess.TimeoutExpired:
            run.kill()
    return {(s, r): d for r, items in got.items() for s, d in items}


@pytest.mark.parametrize("placement", ["remote", "sidecar"])
def test_helm_install_apply_train_and_delete(k8s_node: Cluster, k8s_node_namespace: str, bucket, tmp_path, placement):
    c, ns = k8s_node, k8s_node_namespace
    endpoint, creds = bucket
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    rejects0 = nodemod.reject_counts()
    cfg = install_chart(c, ns)
    timings["helm install -> operator Available"] = time.monotonic() - t0
    try:
        c.kubectl("-n", ns, "create", "secret", "generic", "s3-creds", *[f"--from-literal={k}={v}" for k, v in creds.items()])
        pv = journal_volume(c, ns)
        c.kubectl("-n", ns, "create", "configmap", "trainer", f"--from-file=e2e_trainer.py={TRAINER}")
        mix = {"apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
               "metadata": {"name": "demo", "namespace": ns, "annotations": {"mixplane.io/tokens-per-second": "30000"}},
               "spec": spec(endpoint, placement)}
        t1 = time.monotonic()
        # the operator is Ready once its webhook listens; kube-proxy programs the Service's endpoint a moment later
        c.apply_until_accepted(mix, 30)

        def rolled_out() -> bool:
            st = kget(c, "datamixture", "demo", "-n", ns).get("status") or {}
            if not st.get("plannerEndpoint"):
                return False
            work = kget(c, "deployments,statefulsets", "-n", ns, "-l", "mixplane.io/instance=demo")["items"]
            return bool(work) and all((o.get("status") or {}).get("readyReplicas", 0) == o["spec"]["replicas"] for o in work)

        def operator_failed(final: bool) -> str | None:
            """Stops the wait at once when a handler of the operator raised (it would only retry the same)."""
            log = c.kubectl("-n", ns, "logs", "deploy/mixplane", "--tail=200", check=False).stdout
            if final or "Traceback" in log:
                return (c.kubectl("-n", ns, "get", "pods,dmix,jobs", "-o", "wide", check=False).stdout + "\n"
                        + log[-6000:])
            return None

        wait_for("the mixture's components Ready", rolled_out, 300, 2.0, abort=operator_failed)
        timings["apply -> components Ready"] = time.monotonic() - t1
        prom_cm = prometheus(c, ns, tmp_path)
        prom = prom_cm.__enter__()
        t2 = time.monotonic()
        image = f"mixplane-trainer:{c.image.split(':')[1]}"
        # (sidecar placement: steps of 0.3 s, so Prometheus scrapes the loader containers a few times before they end
        # with the trainers)
        for rank in range(WORLD):
            c.kubectl("apply", "-f", "-", input=json.dumps(trainer_job(ns, rank, image, step_s=0.3 if placement == "sidecar" else 0.0)))

        def train_container(rank: int) -> dict | None:
            pods = kget(c, "pods", "-n", ns, "-l", f"job-name=train-{rank}")["items"]
            return next((x for p in pods for x in (p.get("status") or {}).get("containerStatuses") or []
                         if x["name"] == "train"), None)

        def trainers_done() -> bool:
            # (Prometheus's targets again: the sidecar loaders came with the trainer pods)
            (tmp_path / "targets.json").write_text(json.dumps(annotated_targets(c, ns)))
            # the trainer container's end (under sidecar placement the pod's loader containers end after it)
            states = [((train_container(r) or {}).get("state") or {}).get("terminated") for r in range(WORLD)]
            if any(t and t["exitCode"] != 0 for t in states):
                comps = "".join(f"\n== {p['metadata']['name']} ({p['status'].get('phase')}; "
                                f"{[(x['name'], x['restartCount'], x.get('lastState')) for x in p['status'].get('containerStatuses') or []]})\n"
                                + c.kubectl("-n", ns, "logs", p["metadata"]["name"], "--all-containers", "--tail=25",
                                            check=False).stdout
                                for p in kget(c, "pods", "-n", ns, "-l", "mixplane.io/instance=demo")["items"])
                trainers = [(p["metadata"]["name"], [x["name"] for x in p["spec"]["containers"]])
                            for p in kget(c, "pods", "-n", ns, "-l", "mixplane.io/mixture=demo")["items"]]
                st = json.dumps((kget(c, "datamixture", "demo", "-n", ns).get("status") or {}).get("sidecars"))
                kept = c.keep_logs(ns, f"a trainer failed: {states}")
                raise AssertionError(f"a trainer failed: {states}; trainer pods' containers {trainers}; status.sidecars {st}; "
                                     f"every pod's full log kept in {kept}; REJECTs {nodemod.reject_counts()} (at start "
                                     f"{rejects0})\n"
                                     + c.kubectl("-n", ns, "logs", "-l", "mixplane.io/mixture=demo", "-c", "train", "--tail=50",
                                                 check=False).stdout + comps
                                     + "\n== operator\n" + c.kubectl("-n", ns, "logs", "deploy/mixplane", "--tail=60",
                                                                      check=False).stdout[-6000:])
            return all(states)

        wait_for("the trainers", trainers_done, 600, 1.0)
        timings["trainer Jobs -> trained"] = time.monotonic() - t2
        t_trained = time.monotonic()

        def job_states() -> str:
            return "; ".join(f"{p['metadata']['name']} {p['status'].get('phase')} "
                             f"{[(x['name'], x.get('state')) for x in p['status'].get('containerStatuses') or []]}"
                             for p in kget(c, "pods", "-n", ns, "-l", "mixplane.io/mixture=demo")["items"])

        def jobs_complete() -> bool:
            conds = [{x["type"] for x in (kget(c, "job", f"train-{r}", "-n", ns).get("status") or {}).get("conditions") or []
                      if x.get("status") == "True"} for r in range(WORLD)]
            if any("Failed" in x for x in conds):
                kept = c.keep_logs(ns, f"a trainer Job failed: {conds}")
                raise AssertionError(f"a trainer Job failed: {conds}; pods: {job_states()}; logs kept in {kept}\n"
                                     + c.kubectl("-n", ns, "logs", "-l", "mixplane.io/mixture=demo", "--all-containers",
                                                 "--tail=30", check=False).stdout)
            return all("Complete" in x for x in conds)

        # the Jobs complete: under sidecar placement the loader containers ended with the trainer (mixplane.podend)
        wait_for("the trainer Jobs Complete", jobs_complete, 180, 1.0, abort=lambda final: job_states() if final else None)
        timings["trained -> Jobs Complete"] = time.monotonic() - t_trained
        got: dict[tuple[int, int], str] = {}
        last_step_t = 0.0  # (unix time of the trainers' last step: the sidecar loaders ran then)
        sidecar_containers = 0
        for rank in range(WORLD):
            (pod,) = kget(c, "pods", "-n", ns, "-l", f"job-name=train-{rank}")["items"]
            envs = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env") or []}
            assert (envs.get("MIXPLANE_PLANNER") or "").startswith(f"tcp://demo-planner.{ns}.svc:"), envs
            assert envs.get("MIXPLANE_CURVE_NAME", "").startswith("client-r"), envs  # the pod's rank-bound key
            if placement == "sidecar":  # the webhook added the loader containers the layout put on the pod's slot
                names = [x["name"] for x in pod["spec"]["containers"]]
                slots = {x["slot"]: x for x in (kget(c, "datamixture", "demo", "-n", ns).get("status") or {})["sidecars"]}
                want_pods = slots[rank]["pods"]
                # (a slot may hold none: the layout packs the loader pods biggest first onto the least loaded slot)
                assert names[0] == "train" and len(names) - 1 == len(want_pods), (rank, names, slots)
                assert all(n.startswith(SIDECAR_PREFIX) for n in names[1:]), names
                sidecar_containers += len(names) - 1
                # each loader container ran once and ended with exit 0 after the trainer (the pod Succeeded)
                ended = [x["name"] for x in pod["status"].get("containerStatuses") or [] if x["name"] != "train"
                         and not x.get("restartCount") and "terminated" not in (x.get("lastState") or {})
                         and ((x.get("state") or {}).get("terminated") or {}).get("exitCode") == 0]
                assert sorted(ended) == sorted(names[1:]), (rank, pod["status"].get("containerStatuses"))
                assert pod["status"].get("phase") == "Succeeded", (rank, pod["status"])
                args = next(x for x in pod["spec"]["containers"] if x["name"] == names[-1])["args"] if names[1:] else []
                assert not names[1:] or args[args.index("--trainer-ranks") + 1] == f"{rank}-{rank}", args
            log = c.kubectl("-n", ns, "logs", pod["metadata"]["name"], "-c", "train").stdout
            for line in log.splitlines():
                if line.startswith("{") and '"digest"' in line:
                    o = json.loads(line)
                    got[(o["step"], o["rank"])] = o["digest"]
                    last_step_t = max(last_step_t, float(o["t"]))
        assert len(got) == STEPS * WORLD, sorted(got)
        if placement == "sidecar":  # the layout put loaders into the trainer pods, and none of them restarted
            assert sidecar_containers >= 1
            remote = kget(c, "deployments", "-n", ns, "-l", "mixplane.io/instance=demo,mixplane.io/role=loader")["items"]
            print(f"\nsidecar placement: {sidecar_containers} loader container(s) injected into the trainer pods, "
                  f"{len(remote)} remote loader Deployment(s)")

        # the operator reads the planner's progress on its timer (30 s)
        wait_for("the status's step", lambda: int((kget(c, "datamixture", "demo", "-n", ns).get("status") or {})
                                                   .get("step") or 0) >= STEPS - 1, 120, 2.0)
        table = c.kubectl("-n", ns, "get", "dmix").stdout
        st = kget(c, "datamixture", "demo", "-n", ns)["status"]
        assert st["phase"] == "Running", st
        realised = {s["name"]: s.get("realisedWeight") for s in st["sources"]}
        assert all(isinstance(v, (int, float)) for v in realised.values()), realised
        print(f"\n{table}realised weights: {realised}; conditions: "
              + "; ".join(f"{x['type']}={x['status']} ({x.get('reason')}: {x.get('message')})" for x in st.get("conditions") or []))

        # Prometheus found the components through their pods' annotations; every dashboard query answers.
        # Under sidecar placement the loaders ended with the trainers: what was up, and the queries, at the trainers'
        # last step (the loader containers ran then)
        at = last_step_t if placement == "sidecar" else None

        def targets_up() -> list[str]:
            if at is not None:
                return [x["metric"]["pod"] for x in prom_query(prom, "up == 1", at)]
            with urllib.request.urlopen(f"{prom}/api/v1/targets", timeout=10) as r:
                active = json.loads(r.read())["data"]["activeTargets"]
            return [t["labels"]["pod"] for t in active if t["health"] == "up"]

        wait_for("Prometheus scraping the planner, constructors and loaders", lambda: len(targets_up()) >= 4, 60, 1.0,
                 tolerate=True)
        exprs = [(pnl.title, q.expr) for pnl in PANELS for q in pnl.queries]
        # (the rank imbalance is the balancing strategies' figure: this mixture plans with vanilla)
        need = {t for t, _ in exprs} - {"Rank imbalance"}
        answered: dict[str, list] = {}

        # the sidecar loaders serve on for a few seconds after the last step (until they have had nothing to send):
        # a rate that had only one scrape of them by the last step has two a moment later
        instants = [None] if at is None else [at + d for d in (0.0, 2.0, 4.0, 6.0)]

        def ask(e: str) -> list:
            for t in instants:
                got = prom_query(prom, e, t)
                if got:
                    return got
            return []

        def all_answer() -> bool:  # rates need two scrapes of a series: ask again for a while
            answered.update({e: ask(e) for _, e in exprs})
            return {t for t, e in exprs if answered[e]} >= need

        try:
            wait_for("every dashboard query with data", all_answer, 45, 3.0)
        except AssertionError:
            pass  # asserted below, with the list
        with_data = [t for t, e in exprs if answered[e]]
        print(f"Prometheus: {len(targets_up())} pods scraped through their annotations"
              + (f" (at the trainers' last step: {sorted(targets_up())})" if at is not None else "")
              + f"; {len(exprs)} dashboard queries "
              f"answered, {len(with_data)} with data; without: {sorted({t for t, e in exprs if not answered[e]})}")
        prom_cm.__exit__(None, None, None)
        assert set(with_data) >= need, sorted(need - set(with_data))

        want = reference(endpoint, creds, placement, tmp_path)
        steps = sorted({s for s, _ in got})
        assert sorted(got) == sorted(k for k in want if k[0] in steps), (sorted(got), sorted(want))
        diff = [k for k in got if got[k] != want[k]]
        assert not diff, f"digests differ at (step, rank) {diff[:10]}"
        print(f"digests equal to the embedded run: {len(got)} (steps {steps[0]}..{steps[-1]} x ranks 0..{WORLD - 1}); "
              + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
              + f"; the discipline's REJECTs during the test: { {k: v - rejects0[k] for k, v in nodemod.reject_counts().items()} }")

        # delete: nothing of the mixture is left (pods, Services, Secrets, ConfigMaps, PVC, NetworkPolicies, ...)
        t3 = time.monotonic()
        for r in range(WORLD):  # (the Jobs are the user's: completed, their pods are deleted with them)
            c.kubectl("-n", ns, "delete", "job", f"train-{r}", "--cascade=foreground", "--wait=true", "--timeout=100s",
                      check=False, timeout=120)
        print(f"trainer Jobs deleted in {time.monotonic() - t3:.1f} s")
        c.kubectl("-n", ns, "delete", "datamixture", "demo", "--wait=true", "--timeout=120s", timeout=150)

        def leftovers() -> list[str]:
            kinds = "pods,services,secrets,configmaps,persistentvolumeclaims,networkpolicies,deployments,statefulsets," \
                    "serviceaccounts,poddisruptionbudgets,jobs"
            items = kget(c, kinds, "-n", ns, "-l", "mixplane.io/instance=demo")["items"]
            return [f"{o['kind']}/{o['metadata']['name']}" for o in items]

        wait_for("every child of the mixture gone", lambda: not leftovers(), 120, 1.0)
        assert kget(c, "pv", pv)["status"]["phase"] == "Released"  # its claim was deleted with the mixture
    finally:
        c.kubectl("delete", "pv", f"journal-{ns}"[:63], "--wait=false", check=False)
        cfg.uninstall("mixplane", timeout=120)
