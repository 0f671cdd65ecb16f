"""tune_gc: the planner process's garbage-collection setting (checked in a child process: it is global)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_tune_gc_freezes_start_up_objects():
    code = ("import gc, json; from mixplane.planner.server import tune_gc; before = gc.get_threshold(); "
            "tune_gc(); print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count()]))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    before, after, frozen = json.loads(out.strip().splitlines()[-1])
    assert after == before  # thresholds untouched
    assert frozen > 1000  # the modules imported so far: out of every later collection
