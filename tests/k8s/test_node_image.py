"""The project's image on the real node: built from the Dockerfile by scripts/k8s/images.sh (never pulled), every
component entrypoint starting in a pod as uid 10001 with a read-only root filesystem, and what the components
need at run time working there (numba's cache, tokenizers, pyarrow, `mixplane profile`, the page-index cache:
tests/k8s/image_probe.py). The image's size is reported per image and bounded (docs/deploy.md "Image")."""

from __future__ import annotations

import json

import pytest

from tests.k8s.cluster import Cluster
from tests.k8s.pods import pod_manifest, run_pod

pytestmark = pytest.mark.timeout(900)

PROBE = __import__("pathlib").Path(__file__).with_name("image_probe.py")
MB = 1_000_000


def test_image_config_and_sizes(k8s_node: Cluster):
    n = k8s_node.node
    cfg = json.loads(n.docker("image", "inspect", k8s_node.image).stdout)[0]["Config"]
    assert cfg["User"] == "10001:10001" and cfg["Entrypoint"] == ["mixplane"], cfg
    sizes = {}
    for image in (k8s_node.image, f"mixplane-trainer:{k8s_node.image.split(':')[1]}", "mixplane-python:bookworm",
                  "k8s.gcr.io/pause:3.2"):
        sizes[image] = int(json.loads(n.docker("image", "inspect", image).stdout)[0]["Size"])
    print("image sizes (docker image inspect):", {k: f"{v / MB:.0f} MB" for k, v in sizes.items()})
    # 826 MB before the trims of issue 21 (installers, pyarrow's headers / tests / Flight / ORC / CUDA modules)
    assert sizes[k8s_node.image] < 780 * MB, sizes
    # what the venv holds, largest first (the figures docs/deploy.md quotes)
    sp = "/opt/mixplane/lib/python3.11/site-packages"
    r = n.docker("run", "--rm", "--network", "none", "--entrypoint", "sh", k8s_node.image, "-c",
                 f"du -sm /opt/mixplane; cd {sp} && du -sm llvmlite pyarrow kubernetes numpy numba", timeout=120)
    print("venv (MB):", " ".join(f"{p.rsplit('/', 1)[-1]}={s}" for s, p in (ln.split() for ln in r.stdout.splitlines())))
    assert n.docker("run", "--rm", "--network", "none", "--entrypoint", "python", k8s_node.image, "-c",
                    "import importlib.util as u; assert not u.find_spec('pip')", check=False).returncode == 0, \
        "pip is not in the runtime image"


def test_every_entrypoint_and_runtime_need_in_a_restricted_pod(k8s_node: Cluster, k8s_node_namespace: str):
    ns = k8s_node_namespace
    k8s_node.kubectl("create", "configmap", "probe", "-n", ns, f"--from-file=probe.py={PROBE}")
    code, log, pod = run_pod(k8s_node, ns, pod_manifest(
        "image", k8s_node.image, ["python", "/probe/probe.py"], env={"MIXPLANE_INDEX_CACHE": "/tmp/pageindex"},
        volumes=[{"name": "probe", "configMap": {"name": "probe"}}], mounts=[{"name": "probe", "mountPath": "/probe"}]),
        timeout=300)
    assert code == 0, log
    out = json.loads(log.strip().splitlines()[-1])
    sc = pod["spec"]["containers"][0]["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["runAsUser"] == 10001
    assert (out["uid"], out["gid"]) == (10001, 10001)
    assert out["rootfs"] == "OSError", "the root filesystem is read-only"
    assert all(out[f"entry_{c}"] == 0 for c in ("planner", "loader", "constructor", "operator", "profile")), out
    assert not out["numba_errors"], out["numba_errors"]
    assert out["numba_cache_dir"].startswith("/tmp/") and out["numba_cache_files"] > 0, out
    assert out["numba_warm_s"] < out["numba_cold_s"] / 3, "the second process loads the planner's loops from the cache"
    assert out["tokens"] > 0 and out["parquet_rows"] == 400
    for run in ("profile_cold", "profile_warm"):
        assert out[run]["rc"] == 0, out[run]
        assert out[run]["result"]["sources"]["docs"]["tokens"] > 0
    # one index per file in MIXPLANE_INDEX_CACHE, and beside them `listings/`: the profile's kept listing of the source
    # (loader.listing), written there under the read-only root filesystem
    indexes = [f for f in out["index_cache_files"] if f != "listings"]
    assert len(indexes) == 2 and all(f.endswith(".npz") for f in indexes), out["index_cache_files"]
    assert "listings" in out["index_cache_files"], out["index_cache_files"]
    assert out["index_rows"] == [400, 400]
    print(f"in the pod: numba cold {out['numba_cold_s']:.1f} s, from its cache {out['numba_warm_s']:.2f} s; "
          f"profile {out['profile_cold']['s']} s")
