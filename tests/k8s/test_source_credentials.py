"""Storage credentials in a cluster (issue 13 item 1, "a mounted Secret in a cluster"): a mixture reading
`s3://` names a Secret (`kubernetes.source_secret`), the operator gives its keys to every loader container as
environment (`envFrom`) and to no other component, and the loader pods, run from their templates in an
environment whose own keys the server refuses, read the bucket of a server that checks access keys (s3rver)
with the Secret's keys and feed trainers.
The spec never holds the credentials.
"""

from __future__ import annotations

import json

import pytest

from tests.k8s.helpers import LocalPods, applied, apply, get, operator, run_trainers, trainer_keys
from tests.s3server import S3RVER_KEY, S3rver, credentials_env
from tests.unit.operator_testdata import write_text_and_images

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not S3rver.available(), reason="s3rver is not installed (make s3rver)")]
MIB = 1 << 20


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    data = write_text_and_images(tmp_path_factory.mktemp("cred-data"), text_rows=400, images=4, side=64)
    server = S3rver(("corpus",))
    try:
        assert server.upload_dir(data["text"], "corpus", "text")
        yield server, data
    finally:
        server.stop()


def s3_mixture(ns: str, endpoint: str, tokenizer: str) -> dict:
    prof = {"version": 1, "sources": {"web": {"cpu_s_per_token": 1.5e-6, "memory_per_partition": 40 * MIB}}}
    return {
        "apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
        "metadata": {"name": "demo", "namespace": ns,
                     "annotations": {"mixplane.io/tokens-per-second": "30000", "mixplane.io/profile": json.dumps(prof)}},
        "spec": {
            "sources": [{"name": "web", "uri": "s3://corpus/text/*.parquet", "endpoint": endpoint, "region": "us-east-1",
                         "tokenizer": tokenizer}],
            "mixture": {"weights": {"web": 1.0}, "seed": 3},
            "batch": {"sequences": 4, "seq_len": 128},
            "topology": {"modules": {"backbone": {"dp": 2}}, "ranks_per_node": 1},
            "runtime": {"window": 8, "constructors": "per_node"},
            "kubernetes": {"source_secret": "s3-creds", "journal_mb": 0},
        },
    }


def test_loaders_read_the_bucket_with_the_secrets_credentials_only(crd, k8s_namespace, bucket, tmp_path, monkeypatch):
    cluster, ns = crd, k8s_namespace
    server, data = bucket
    # the environment the pods inherit here holds keys s3rver refuses (s3rver serves unsigned requests, so no keys
    # would prove nothing): only the Secret's keys, given to the loaders by envFrom, can read the bucket
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    for k, v in credentials_env("not-the-key").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    creds = credentials_env(S3RVER_KEY)
    cluster.kubectl("-n", ns, "create", "secret", "generic", "s3-creds",
                    *[f"--from-literal={k}={creds[k]}" for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")])
    pods = LocalPods(cluster, ns, tmp_path / "pods")
    (tmp_path / "pods").mkdir()
    planner_host = f"demo-planner.{ns}.svc:7000"
    with operator(cluster, ns, MIXPLANE_OPERATOR_PLANNER=f"tcp://127.0.0.1:{pods.planner_port}"):
        try:
            apply(cluster, s3_mixture(ns, server.endpoint, data["tokenizer"]))
            kids = applied(cluster, ns)
            assert creds["AWS_SECRET_ACCESS_KEY"] not in json.dumps(get(cluster, "datamixture", "demo", "-n", ns))
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
            assert not pods.dead(), pods.logs()
        finally:
            pods.stop()
