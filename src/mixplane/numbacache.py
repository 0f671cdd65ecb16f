"""Where numba keeps the compiled kernels' machine code: beside the module, else a writable cache directory.

numba caches compiled code (cache=True) next to the module's source, else in the user's cache; with neither
writable (a read-only image) caching would fail. `ensure_cache_dir` names a writable directory explicitly
(NUMBA_CACHE_DIR) in that case. It must run before numba is imported: numba reads the setting once, at import.
"""

from __future__ import annotations

import os
import tempfile


def ensure_cache_dir(module_file: str) -> None:
    """Make numba's cache usable for the module at `module_file` (its __pycache__), else set NUMBA_CACHE_DIR to the
    user's cache or a per-user temporary directory. A NUMBA_CACHE_DIR already set is kept."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    here = os.path.join(os.path.dirname(os.path.abspath(module_file)), "__pycache__")
    if os.access(here if os.path.isdir(here) else os.path.dirname(here), os.W_OK):
        return
    for d in (os.path.join(os.path.expanduser("~"), ".cache", "mixplane", "numba"),
              os.path.join(tempfile.gettempdir(), f"mixplane-numba-{os.getuid()}")):
        try:
            os.makedirs(d, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            os.environ["NUMBA_CACHE_DIR"] = d
            return
