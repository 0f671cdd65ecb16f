"""The layers of docs/architecture.md hold: import-linter's contracts (pyproject.toml) on this checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " broken" in r.stdout and "0 broken" in r.stdout
