# Two commands on a fresh machine: `make demo` (the main job) and `make test` (every test).
# Both create .venv and install everything the project needs.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo setup test test-unit test-integration test-k8s k8s-tools crds bench-quick clean venv s3rver

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	# the CPU build of torch that lies on these machines; must come before anything that depends on torch
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[torch,test,k8s,bench,s3test,hf,lightning,megatron,prep,iceberg]'
	# the torchtitan extra without its resolver conflicts (see pyproject.toml): exactly its pins, no dependencies
	$(PY) -m pip install --quiet --no-deps torchtitan==0.3.0 torchdata==0.11.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mixplane demo --dir .mixplane/demo-data

# what the tests need, installed side by side: the venv's downloads overlap the k8s build's compiling (cold, the
# three take ~8, ~13 and ~1 min one after the other)
setup:
	$(MAKE) -j3 --output-sync=target --no-print-directory $(STAMP) k8s-tools s3rver

# static checks first (seconds), then every test
test: setup
	$(PY) -m ruff check src
	$(VENV)/bin/lint-imports
	$(PY) -m mypy
	bash scripts/run-tests.sh $(PY) tests -q

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit -q

test-integration: $(STAMP) s3rver
	$(PY) -m pytest tests/integration -q

# etcd, kube-apiserver + kube-controller-manager 1.20.2 (built from Debian's source package, cached in
# ~/.cache/mixplane/k8s-1.20.2; ~7 min cold), kubectl and prometheus for tests/k8s (apt-get: needs root, as CI is);
# the node: kubelet, kube-scheduler, kube-proxy from the same tree, Debian's docker.io, and every image it runs built
# here (scripts/k8s/images.sh: debootstrap base, pause, the project's Dockerfile, the trainer; ~6 min cold)
k8s-tools:
	bash scripts/k8s/build.sh node
	bash scripts/k8s/images.sh

test-k8s: $(STAMP) k8s-tools
	$(PY) -m pytest tests/k8s -q

# regenerate what is generated from the spec model and the metrics
crds: $(STAMP)
	$(VENV)/bin/mixplane crd --out crds/datamixtures.mixplane.io.yaml --out charts/mixplane/crds/datamixtures.mixplane.io.yaml
	$(PY) -m mixplane.operator.dashboard > charts/mixplane/dashboards/mixplane.json

bench-quick: $(STAMP)
	for b in bench/*.py; do $(PY) $$b --quick || exit 1; done

clean:
	rm -rf .mixplane .pytest_cache

# s3rver 3.7.1 (npm; needs node): the S3-compatible server bench/remote_io.py prefers (ranges streamed from disk)
# (tests/integration/test_remote_sources.py: credentials refused by a server that checks them)
s3rver:
	test -x $(HOME)/.cache/mixplane/s3rver/node_modules/.bin/s3rver || \
	  (mkdir -p $(HOME)/.cache/mixplane/s3rver && \
	   npm install --no-audit --no-fund --prefix $(HOME)/.cache/mixplane/s3rver s3rver@3.7.1)
