"""A mixture whose sources live on S3 (moto's server, its own process, over HTTP), end to end through
the embedded runtime's loader processes: the batches every rank receives equal those of the same
mixture over the local copies, and replay rebuilds a step of the remote run exactly."""

import os

import numpy as np
import pytest

from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.conftest import token_mixture
from tests.integration.test_runtime import fetch
from tests.s3server import MotoS3, credentials_env

pytestmark = pytest.mark.timeout(400)
MODES = {"a": "page", "b": "row", "c": "sequential"}


@pytest.fixture(scope="module")
def s3_sources(token_sources):
    saved = {k: os.environ.get(k) for k in credentials_env()}
    os.environ.update(credentials_env())  # the loader processes inherit them, as pods get them from a Secret
    server = MotoS3(process=True)
    for n in MODES:
        server.upload_dir(str(token_sources["root"] / n), "mix", n)
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def mixture(token_sources, endpoint=None):
    doc = token_mixture(token_sources["root"])
    for s in doc["sources"]:
        s["shuffle"] = MODES[s["name"]]
        if endpoint is not None:
            s.update(uri=f"s3://mix/{s['name']}/", endpoint=endpoint, region="us-east-1")
    return parse_spec(doc)


def test_remote_mixture_equals_local_and_replays(token_sources, s3_sources, tmp_path):
    from mixplane.replay import replay_step

    steps = 6
    with EmbeddedRuntime(mixture(token_sources), tmp_path / "local") as rt:
        local = fetch(rt.planner_endpoint, 2, steps)
    spec = mixture(token_sources, s3_sources.endpoint)
    with EmbeddedRuntime(spec, tmp_path / "remote") as rt:
        remote = fetch(rt.planner_endpoint, 2, steps)
    for r in (0, 1):
        assert len(local[r]) == len(remote[r]) == steps
        for a, b in zip(local[r], remote[r]):
            assert a.keys() == b.keys()
            for k in a:
                assert np.array_equal(a[k], b[k]), (r, k)
    out = replay_step(spec, step=4, rank=1, run_dir=str(tmp_path / "remote"), save=str(tmp_path / "b.npz"))
    assert out["digest_match"], out
    saved = np.load(tmp_path / "b.npz")
    for k in saved.files:
        assert np.array_equal(saved[k], remote[1][4][k]), k
