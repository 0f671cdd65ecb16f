"""One exception root: every exception class mixplane defines is a MixplaneError (and keeps its built-in kind)."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import mixplane
from mixplane.errors import MixplaneError

SRC = Path(mixplane.__file__).parent
# errors only: SystemExit, KeyboardInterrupt and GeneratorExit are how a process stops, not errors
BUILTIN = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), Exception)}


def exception_classes() -> dict[str, tuple[str, list[str]]]:
    classes: dict[str, tuple[str, list[str]]] = {}
    for p in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases]
                classes[node.name] = (str(p.relative_to(SRC)), bases)
    exc = {n for n, (_, b) in classes.items() if set(b) & BUILTIN or n == "MixplaneError"}
    grown = True
    while grown:  # subclasses of exception classes are exception classes
        more = {n for n, (_, b) in classes.items() if set(b) & exc} - exc
        exc |= more
        grown = bool(more)
    return {n: classes[n] for n in exc}


def test_every_exception_class_descends_from_mixplane_error():
    exc = exception_classes()
    assert len(exc) > 30

    def rooted(name: str, seen: frozenset = frozenset()) -> bool:
        if name == "MixplaneError":
            return True
        _, bases = exc[name]
        return any(b in exc and b not in seen and rooted(b, seen | {name}) for b in bases)

    loose = {n: f for n, (f, _) in exc.items() if not rooted(n)}
    assert not loose, f"exceptions outside MixplaneError (add it to their bases): {loose}"


def test_the_root_keeps_the_built_in_kinds():
    from mixplane.client import DeliveryError
    from mixplane.loader.remote import MissingObjectError, RemoteError
    from mixplane.spec import SpecError
    from mixplane.wire import WireError

    assert issubclass(SpecError, ValueError) and issubclass(WireError, ValueError) and issubclass(DeliveryError, RuntimeError)
    assert issubclass(MissingObjectError, FileNotFoundError) and issubclass(RemoteError, OSError)
    for e in (SpecError, WireError, DeliveryError, MissingObjectError):
        assert issubclass(e, MixplaneError)
