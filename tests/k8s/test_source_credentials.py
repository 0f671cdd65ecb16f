"""Storage credentials in a cluster (issue 13 item 1, "a mounted Secret in a cluster"): a mixture reading
`s3://` names a Secret (`kubernetes.source_secret`), the operator gives its keys to every loader container as
environment (`envFrom`) and to no other component, and the loader pods, run from their templates in an
environment whose own keys the server refuses, read the bucket of a server that checks access keys (s3rver)
with the Secret's keys and feed trainers.
The spec never holds the credentials.

The operator never holds them either, so it cannot profile such sources itself: it runs a profiling Job with the
loaders' image and the same Secret, and reads the measured costs back from the pod's termination message
(run here as a local process, its end written into the pod's status as a kubelet would). The profile lands in the
status; a Job that fails (keys the server refuses) gives Degraded/FallbackCosts naming it, with no key in it.
"""

from __future__ import annotations

import json

import pytest

from tests.k8s.helpers import LocalPods, applied, apply, children, get, operator, run_job_pod, run_trainers, status_of, trainer_keys, wait_for
from tests.s3server import S3RVER_KEY, S3rver, credentials_env
from tests.unit.operator_testdata import write_text_and_images

pytestmark = pytest.mark.timeout(600)
MIB = 1 << 20


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    assert S3rver.available(), "these tests need s3rver, the key-checking S3 server: make s3rver (make test installs it)"
    data = write_text_and_images(tmp_path_factory.mktemp("cred-data"), text_rows=400, images=4, side=64)
    server = S3rver(("corpus",))
    try:
        assert server.upload_dir(data["text"], "corpus", "text")
        yield server, data
    finally:
        server.stop()


def s3_mixture(ns: str, endpoint: str, tokenizer: str, *, secret: str = "s3-creds") -> dict:
    return {
        "apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
        "metadata": {"name": "demo", "namespace": ns, "annotations": {"mixplane.io/tokens-per-second": "30000"}},
        "spec": {
            "sources": [{"name": "web", "uri": "s3://corpus/text/*.parquet", "endpoint": endpoint, "region": "us-east-1",
                         "tokenizer": tokenizer}],
            "mixture": {"weights": {"web": 1.0}, "seed": 3},
            "batch": {"sequences": 4, "seq_len": 128},
            "topology": {"modules": {"backbone": {"dp": 2}}, "ranks_per_node": 1},
            "runtime": {"window": 8, "constructors": "per_node"},
            "kubernetes": {"source_secret": secret, "journal_mb": 0},
        },
    }


def refused_environment(monkeypatch, tmp_path) -> None:
    """The environment the pods inherit here holds keys s3rver refuses (s3rver serves unsigned requests, so no keys
    would prove nothing): only a Secret's keys, given by envFrom, can read the bucket."""
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    for k, v in credentials_env("not-the-key").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


def profiling_pods(cluster, ns: str, done: set[str]) -> list[dict]:
    """The profiling Jobs' pods the Job controller made that have not run yet (nor are going away)."""
    items = get(cluster, "pods", "-n", ns, "-l", "mixplane.io/profile-of=demo")["items"]
    return [p for p in items if p["metadata"]["name"] not in done and not p["metadata"].get("deletionTimestamp")
            and not (p.get("status") or {}).get("containerStatuses")]


def run_profiling(cluster, ns: str, pods: LocalPods, want: int, done: set[str] | None = None,
                  timeout: float = 120.0) -> list[tuple[int, str]]:
    """Run `want` profiling pods as the kubelet would, as the Job controller makes them (a retry after a failure);
    `done`: the pods run before (their names are added)."""
    done = set() if done is None else done
    out = []
    while len(out) < want:
        pod = wait_for("a profiling pod", lambda: profiling_pods(cluster, ns, done), timeout)[0]
        done.add(pod["metadata"]["name"])
        out.append(run_job_pod(pods, pod))
    return out


def test_loaders_read_the_bucket_with_the_secrets_credentials_only(crd, k8s_namespace, bucket, tmp_path, monkeypatch):
    cluster, ns = crd, k8s_namespace
    server, data = bucket
    # the environment the pods inherit here holds keys s3rver refuses (s3rver serves unsigned requests, so no keys
    # would prove nothing): only the Secret's keys, given to the loaders by envFrom, can read the bucket
    refused_environment(monkeypatch, tmp_path)
    creds = credentials_env(S3RVER_KEY)
    cluster.kubectl("-n", ns, "create", "secret", "generic", "s3-creds",
                    *[f"--from-literal={k}={creds[k]}" for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")])
    pods = LocalPods(cluster, ns, tmp_path / "pods")
    (tmp_path / "pods").mkdir()
    planner_host = f"demo-planner.{ns}.svc:7000"
    with operator(cluster, ns, MIXPLANE_OPERATOR_PLANNER=f"tcp://127.0.0.1:{pods.planner_port}", MIXPLANE_PROFILE_POLL_S="1") as op:
        try:
            apply(cluster, s3_mixture(ns, server.endpoint, data["tokenizer"]))
            # the operator cannot read the bucket (it never holds the Secret): it waits for its profiling Job
            wait_for("phase Profiling", lambda: status_of(cluster, ns).get("phase") == "Profiling", 60)
            (job,) = get(cluster, "jobs", "-n", ns, "-l", "mixplane.io/profile-of=demo")["items"]
            assert job["metadata"]["ownerReferences"][0]["name"] == "demo"
            assert job["spec"]["template"]["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
            # nothing is sized before the profile: only the components' ServiceAccount (no rights) the Job runs as
            assert set(children(cluster, ns)) == {("ServiceAccount", "demo-mixplane")}
            ((code, message),) = run_profiling(cluster, ns, pods, 1)
            assert code == 0, (message, pods.logs())
            kids = applied(cluster, ns)
            st = status_of(cluster, ns)
            (web,) = st["sources"]
            # the costs measured in the Job, through the Secret's keys, are what the status keeps
            measured = json.loads(message)["sources"]["web"]
            assert web["profile"]["measuredBy"] == "job" and web["profile"]["cpuSecondsPerToken"] == measured["cpu_s_per_token"] > 0
            assert web["profile"]["memoryPerPartition"] == measured["memory_per_partition"] > 0
            assert st["profiling"]["state"] == "Succeeded" and st["profiling"]["jobs"] == [job["metadata"]["name"]]
            assert {c["type"]: c["reason"] for c in st["conditions"]}["Degraded"] == "AsPlanned"
            wait_for("the Job complete", lambda: any(c["type"] == "Complete" and c["status"] == "True" for c in
                     (get(cluster, "job", job["metadata"]["name"], "-n", ns).get("status") or {}).get("conditions") or []), 60)
            for text in (json.dumps(get(cluster, "datamixture", "demo", "-n", ns)), op.log_text(),
                         json.dumps(get(cluster, "configmaps", "-n", ns)["items"])):
                assert creds["AWS_SECRET_ACCESS_KEY"] not in text and creds["AWS_ACCESS_KEY_ID"] not in text
            for (kind, name), o in kids.items():
                if kind not in ("Deployment", "StatefulSet"):
                    continue
                (c,) = o["spec"]["template"]["spec"]["containers"]
                want = [{"secretRef": {"name": "s3-creds"}}] if o["metadata"]["labels"]["mixplane.io/role"] == "loader" else None
                assert c.get("envFrom") == want, (name, c.get("envFrom"))
            pods.start_mixture(kids, planner_host)
            # the environment's own keys are refused: what reads the bucket below is the Secret's
            from mixplane.loader.stream import open_stream
            from mixplane.spec import SourceSpec

            with pytest.raises(Exception, match="access denied"):
                open_stream(SourceSpec(name="web", uri="s3://corpus/text/*.parquet", endpoint=server.endpoint,
                                       region="us-east-1", kind="text", columns=["text"], tokenizer=data["tokenizer"]),
                            seed=0, buffer_rows=10)
            try:
                got = run_trainers(f"tcp://127.0.0.1:{pods.planner_port}", trainer_keys(cluster, ns, tmp_path / "keys"), 2, 4)
            except AssertionError as e:
                raise AssertionError(f"{e}; dead: {pods.dead()}\n{pods.logs()}") from None
            assert got[0] == got[1] == list(range(4)), (got, pods.dead())
            assert all(n.startswith(job["metadata"]["name"]) for n, _ in pods.dead()), pods.logs()  # only the Job's pod ended
        finally:
            pods.stop()
    # a restarted operator plans with the profile the status keeps: no new Job, nothing measured again
    profiled = status_of(cluster, ns)["sources"][0]["profile"]
    with operator(cluster, ns, MIXPLANE_PROFILE_POLL_S="1") as again:
        line = wait_for("the restarted operator's reconcile", lambda: next(
            (x for x in again.log_text().splitlines() if "reconciled:" in x), None), 60)
    assert "'objects'" in line and "profiling" not in line, line
    assert [j["metadata"]["uid"] for j in get(cluster, "jobs", "-n", ns, "-l", "mixplane.io/profile-of=demo")["items"]] == [job["metadata"]["uid"]]
    assert status_of(cluster, ns)["sources"][0]["profile"] == profiled


def test_a_failed_profiling_job_falls_back_and_says_why_without_the_keys(crd, k8s_namespace, bucket, tmp_path, monkeypatch):
    cluster, ns = crd, k8s_namespace
    server, data = bucket
    refused_environment(monkeypatch, tmp_path)
    wrong = credentials_env("a-key-s3rver-refuses")
    cluster.kubectl("-n", ns, "create", "secret", "generic", "wrong-creds",
                    *[f"--from-literal={k}={wrong[k]}" for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")])
    pods = LocalPods(cluster, ns, tmp_path / "pods")
    (tmp_path / "pods").mkdir()
    with operator(cluster, ns, MIXPLANE_PROFILE_POLL_S="1") as op:
        try:
            apply(cluster, s3_mixture(ns, server.endpoint, data["tokenizer"], secret="wrong-creds"))
            # backoffLimit 1: the pod and its retry both fail, then the Job does
            ran: set[str] = set()
            runs = run_profiling(cluster, ns, pods, 2, ran)
            assert all(c != 0 and json.loads(m)["error"] for c, m in runs), runs
            applied(cluster, ns)
            st = wait_for("Degraded", lambda: (s := status_of(cluster, ns)).get("profiling", {}).get("state") == "Failed" and s, 60)
            deg = {c["type"]: c for c in st["conditions"]}["Degraded"]
            assert deg["status"] == "True" and deg["reason"] == "FallbackCosts"
            assert "BackoffLimitExceeded" in deg["message"] and "web" in deg["message"], deg
            assert "sources[0].uri" in deg["message"] and "access denied" in deg["message"], deg  # the pod's own words
            assert st["sources"][0]["profile"]["measuredBy"] == "fallback"
            for text in (json.dumps(get(cluster, "datamixture", "demo", "-n", ns)), op.log_text(), *(m for _, m in runs)):
                assert wrong["AWS_SECRET_ACCESS_KEY"] not in text and wrong["AWS_ACCESS_KEY_ID"] not in text
            # the failed Job is not re-run on its own; the Secret fixed, the Job deleted and the mixture touched (any
            # update reconciles), the sources are profiled again
            right = credentials_env(S3RVER_KEY)
            cluster.kubectl("-n", ns, "delete", "secret", "wrong-creds")
            cluster.kubectl("-n", ns, "create", "secret", "generic", "wrong-creds",
                            *[f"--from-literal={k}={right[k]}" for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")])
            cluster.kubectl("-n", ns, "delete", "jobs", "-l", "mixplane.io/profile-of=demo", "--wait=true")
            cluster.kubectl("-n", ns, "annotate", "datamixture", "demo", "example.com/profile-again=1")
            ((code, message),) = run_profiling(cluster, ns, pods, 1, ran)
            assert code == 0, message
            st = wait_for("the measured profile", lambda: (s := status_of(cluster, ns))["sources"][0]["profile"].get("measuredBy") == "job" and s, 60)
            assert {c["type"]: c["reason"] for c in st["conditions"]}["Degraded"] == "AsPlanned" and st["profiling"]["state"] == "Succeeded"
            assert st["sources"][0]["profile"]["cpuSecondsPerToken"] == json.loads(message)["sources"]["web"]["cpu_s_per_token"]
        finally:
            pods.stop()


def test_sources_the_operator_cannot_read_are_profiled_by_a_job(crd, k8s_namespace, bucket, tmp_path, monkeypatch):
    """No source Secret: the operator tries in-process, cannot read (its own keys are refused), and profiles by Job;
    the pods' environment (the node's identity, here the test's) can."""
    cluster, ns = crd, k8s_namespace
    server, data = bucket
    refused_environment(monkeypatch, tmp_path)
    for k, v in credentials_env(S3RVER_KEY).items():  # what pods inherit here: keys s3rver takes
        monkeypatch.setenv(k, v)
    mix = s3_mixture(ns, server.endpoint, data["tokenizer"])
    del mix["spec"]["kubernetes"]["source_secret"]
    pods = LocalPods(cluster, ns, tmp_path / "pods")
    (tmp_path / "pods").mkdir()
    with operator(cluster, ns, MIXPLANE_PROFILE_POLL_S="1", **credentials_env("not-the-key")) as op:
        try:
            apply(cluster, mix)
            ((code, message),) = run_profiling(cluster, ns, pods, 1)
            assert code == 0, message
            applied(cluster, ns)
            st = status_of(cluster, ns)
            assert st["sources"][0]["profile"]["measuredBy"] == "job" and st["profiling"]["state"] == "Succeeded", st
            assert "profiling in the operator failed" in op.log_text()
            (job,) = get(cluster, "jobs", "-n", ns, "-l", "mixplane.io/profile-of=demo")["items"]
            assert "envFrom" not in job["spec"]["template"]["spec"]["containers"][0]
        finally:
            pods.stop()
