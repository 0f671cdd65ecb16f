"""tune_gc: the planner process's garbage-collection settings (checked in a child process: they are global)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_tune_gc_freezes_start_up_objects_and_raises_the_young_threshold():
    code = ("import gc, json; from mixplane.planner.server import GC_YOUNG_THRESHOLD, tune_gc; before = gc.get_threshold(); "
            "tune_gc(); print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count(), GC_YOUNG_THRESHOLD]))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    before, after, frozen, young = json.loads(out.strip().splitlines()[-1])
    assert after == [max(before[0], young), before[1], before[2]] and after[0] >= 20_000
    assert frozen > 1000  # the modules imported so far: out of every later collection
