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


def test_component_processes_do_not_import_torch():
    """`mixplane planner|loader|constructor` load the CLI and their server modules, never torch (the client's extra)."""
    code = (
        "import sys\n"
        "from mixplane import cli\n"
        "import mixplane.planner.server, mixplane.loader.server, mixplane.loader.host, mixplane.loader.memory\n"
        "import mixplane.constructor.server, mixplane.runtime, mixplane.checks\n"
        "cli.build_parser().parse_args(['planner', '--spec', 'x.json'])\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"
    # and the client does import it: the check above would notice a torch import
    r = subprocess.run([sys.executable, "-c", code.replace("import sys\n", "import sys\nimport mixplane.client\n")],
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "'torch'" in r.stdout, r.stderr[-2000:]


def test_ruff_and_mypy_pass_on_src():
    """The static checks `make test` runs first (configured in pyproject.toml), so `pytest tests` sees them too."""
    for cmd in ([sys.executable, "-m", "ruff", "check", "--no-cache", "src"], [sys.executable, "-m", "mypy"]):
        r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{' '.join(cmd[2:])}:\n{r.stdout[-4000:]}{r.stderr[-2000:]}"
