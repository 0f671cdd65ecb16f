# Two commands on a fresh machine: `make demo` (the main job) and `make test` (every test).
# Both create .venv and install everything the project needs.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test test-unit test-integration bench-quick clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	# the CPU build of torch that lies on these machines; must come before anything that depends on torch
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[torch,test,k8s,bench]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mixplane demo --dir .mixplane/demo-data

# static checks first (seconds), then every test
test: $(STAMP)
	$(PY) -m ruff check src
	$(VENV)/bin/lint-imports
	$(PY) -m mypy
	$(PY) -m pytest tests -q

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit -q

test-integration: $(STAMP)
	$(PY) -m pytest tests/integration -q

bench-quick: $(STAMP)
	for b in bench/*.py; do $(PY) $$b --quick || exit 1; done

clean:
	rm -rf .mixplane .pytest_cache
