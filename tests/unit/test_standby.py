"""The warm standby (mixplane.standby): its take-over order is checked field by field, and a real standby
process becomes the component its order names (argv, log file, exit code) or exits at the end of its input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mixplane.control import read_ready
from mixplane.standby import OrderError, parse_order
from tests.conftest import token_mixture

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_an_order_is_argv_env_and_log():
    line = json.dumps({"argv": ["--log-level", "INFO", "planner", "--spec", "s.json"], "env": {"A": "1"}, "log": "/x.log"})
    assert parse_order(line) == {"argv": ["--log-level", "INFO", "planner", "--spec", "s.json"], "env": {"A": "1"},
                                 "log": "/x.log"}


@pytest.mark.parametrize("line, field", [
    ("planner --spec s.json", "not JSON"),
    ("[1, 2]", "expected an object"),
    (json.dumps({"argv": [], "env": {}, "log": "/x"}), "field argv"),
    (json.dumps({"argv": ["planner", 3], "env": {}, "log": "/x"}), "field argv"),
    (json.dumps({"argv": ["planner"], "env": {"A": 1}, "log": "/x"}), "field env"),
    (json.dumps({"argv": ["planner"], "env": {}, "log": ""}), "field log"),
])
def test_a_bad_order_names_its_field(line, field):
    with pytest.raises(OrderError, match=field):
        parse_order(line)


def start_standby(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    ready = tmp_path / "standby.json"
    proc = subprocess.Popen([sys.executable, "-m", "mixplane.standby", "--ready-file", str(ready)],
                            stdin=subprocess.PIPE, stdout=open(tmp_path / "standby.log", "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": SRC, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while read_ready(ready) is None:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "standby.log").read_text()
        time.sleep(0.05)
    assert read_ready(ready)["pid"] == proc.pid
    return proc, ready


def test_a_prepared_standby_becomes_the_component_of_its_order(tmp_path):
    proc, _ = start_standby(tmp_path)
    try:
        spec_file = tmp_path / "mix.yaml"
        spec_file.write_text(yaml.safe_dump(token_mixture(tmp_path / "no-data")))
        log = tmp_path / "component.log"
        order = {"argv": ["--log-level", "INFO", "validate", str(spec_file), "--no-files"],
                 "env": {**os.environ, "PYTHONPATH": SRC}, "log": str(log)}
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(order) + "\n").encode())
        proc.stdin.close()
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert f"{spec_file}: valid" in text, text  # mixplane validate's own output, in the component's log
    assert code == 0
    assert "taking over as --log-level INFO validate" in (tmp_path / "standby.log").read_text()


def test_a_standby_exits_at_the_end_of_its_input(tmp_path):
    proc, _ = start_standby(tmp_path)
    try:
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_every_module_a_standby_prepares_exists():
    """A module renamed or removed under the standby's list would make every standby die at start (and restarts
    fall back to new interpreters): each must import."""
    import importlib

    from mixplane.standby import MODULES

    for name in MODULES:
        importlib.import_module(name)
