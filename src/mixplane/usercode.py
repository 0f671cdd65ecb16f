"""User code named in a spec -- a strategy, a constructor or loader hook -- loaded one way everywhere.

``package.module:function`` (imported) or ``path/to/file.py:function`` (relative paths against the spec file's
directory), and its options bound and checked against the function's signature now, so a wrong option is an
error at validation or start-up naming it, not a TypeError mid-run. Imports nothing of mixplane's components:
the planner, the constructors and the loaders use it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from mixplane.errors import MixplaneError


class UserCodeError(MixplaneError, ValueError):
    """User code that cannot be loaded or does not accept its options; the text names it (and `what` it is)."""


def load_callable(name: str, base_dir: str | os.PathLike | None = None, what: str = "strategy",
                  error: type[UserCodeError] = UserCodeError) -> Callable[..., Any]:
    """`package.module:function` or `path/to/file.py:function` (relative paths against base_dir)."""
    mod, sep, fn = name.rpartition(":")
    if not sep or not mod or not fn:
        raise error(f"{what} {name!r}: expected package.module:function or file.py:function")
    try:
        if mod.endswith(".py"):
            path = mod if os.path.isabs(mod) or base_dir is None else os.path.join(str(base_dir), mod)
            path = os.path.abspath(os.path.expanduser(path))
            modname = "mixplane_user_" + os.path.splitext(os.path.basename(path))[0]
            spec = importlib.util.spec_from_file_location(modname, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[modname] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod)
        obj = getattr(module, fn)
    except Exception as e:  # noqa: BLE001 - user code may raise anything at import (SyntaxError, ...)
        raise error(f"{what} {name!r}: cannot import: {type(e).__name__}: {e}") from None
    if not callable(obj):
        raise error(f"{what} {name!r} is not callable")
    return obj


def bind_options(fn: Callable[..., Any], options: Mapping[str, Any], name: str, what: str = "strategy",
                 error: type[UserCodeError] = UserCodeError, ignore: Iterable[str] = ()) -> Callable[..., Any]:
    """fn with `options` bound as keywords (those in `ignore` left out), checked against its signature now."""
    skip = set(ignore)
    opts = {k: v for k, v in options.items() if k not in skip}
    if not opts:
        return fn
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        params = list(sig.parameters.values())
        has_kwargs = any(p.kind == p.VAR_KEYWORD for p in params)
        accepted = {p.name for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = sorted(set(opts) - accepted) if not has_kwargs else []
        if unknown:
            raise error(f"{what} {name!r} does not accept option(s) {', '.join(unknown)} "
                        f"(it takes: {', '.join(sorted(accepted)) or 'none'})")
    return functools.partial(fn, **opts)
