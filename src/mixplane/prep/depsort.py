"""Depsort (seed 004): a repository's Python files in dependency order, so a model sees definitions before their
uses. Pure (`ast`, no I/O).

The graph: file A depends on file B when A imports B's module (``import pkg.b``, ``from pkg.b import x``,
relative ``from . import b`` / ``from .b import x``) or imports a name from a package that B defines
(``from pkg import name`` with ``name`` defined in ``pkg/__init__.py``, or ``pkg/name.py``). Symbols come from
the syntax tree, not from text search. A file that does not parse keeps its place and no edges (its name is
reported).

The order: repositories have import cycles, so a strict topological order may not exist. Seed 004 breaks cycles
where a depth-first search happens to meet them; here the order is the Eades-Lin-Smyth heuristic for the
minimum feedback arc set (sinks first, sources last, then the node with the largest out-minus-in degree), which
keeps more dependency edges than an arbitrary break: every edge of an acyclic graph, and on cyclic ones at least
half of them. Ties go by path, so the order is deterministic.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class FileSymbols:
    path: str
    module: str  # dotted module name (pkg/sub/mod.py -> pkg.sub.mod; pkg/__init__.py -> pkg)
    defines: set[str] = field(default_factory=set)  # top-level functions, classes, assigned names
    imports: set[str] = field(default_factory=set)  # modules it imports (absolute, dotted)
    from_imports: set[tuple[str, str]] = field(default_factory=set)  # (module, name) of `from module import name`
    error: str | None = None


def module_of(path: str) -> str:
    parts = path.replace("\\", "/").removesuffix(".py").split("/")
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(p for p in parts if p)


def _resolve(module: str | None, level: int, current: str, is_package: bool) -> str:
    if level == 0:
        return module or ""
    base = current.split(".") if current else []
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, *([module] if module else [])])


def symbols(path: str, source: str) -> FileSymbols:
    """What one file defines and imports (its syntax tree; a file that does not parse: `error` set, nothing else)."""
    mod = module_of(path)
    out = FileSymbols(path, mod)
    try:
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError) as e:
        out.error = f"{path}: {type(e).__name__}: {e}"
        return out
    is_pkg = path.endswith("__init__.py")
    for node in tree.body:  # top level only: what other files can import
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.defines.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                out.defines.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    for any_node in ast.walk(tree):
        if isinstance(any_node, ast.Import):
            out.imports.update(a.name for a in any_node.names)
        elif isinstance(any_node, ast.ImportFrom):
            base = _resolve(any_node.module, any_node.level, mod, is_pkg)
            if base:
                out.imports.add(base)
            for a in any_node.names:
                if a.name != "*":
                    out.from_imports.add((base, a.name))
    return out


def dependency_edges(files: Iterable[FileSymbols]) -> set[tuple[str, str]]:
    """(A, B) for every file A that depends on file B of the same repository (paths; no self edges)."""
    fs = list(files)
    by_module = {f.module: f for f in fs}
    edges: set[tuple[str, str]] = set()
    for f in fs:
        targets: set[str] = set()
        for m in f.imports:
            # `import a.b.c` uses a, a.b and a.b.c (packages' __init__ run first)
            parts = m.split(".")
            for i in range(1, len(parts) + 1):
                g = by_module.get(".".join(parts[:i]))
                if g is not None:
                    targets.add(g.path)
        for m, name in f.from_imports:
            sub = by_module.get(f"{m}.{name}" if m else name)
            if sub is not None:  # from pkg import module
                targets.add(sub.path)
            g = by_module.get(m)
            if g is not None and (name in g.defines or sub is None):
                targets.add(g.path)
        edges.update((f.path, t) for t in targets if t != f.path)
    return edges


def best_effort_order(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> list[str]:
    """Nodes ordered so that as many (A depends on B) edges as possible have B before A: Eades-Lin-Smyth on the
    reversed dependency graph (B -> A: definitions flow to uses). Deterministic (ties by name)."""
    nodes = sorted(set(nodes))
    out_: dict[str, set[str]] = defaultdict(set)  # B -> users A
    in_: dict[str, set[str]] = defaultdict(set)  # A -> what it uses
    for a, b in edges:
        if a != b:
            out_[b].add(a)
            in_[a].add(b)
    alive = set(nodes)
    head: list[str] = []
    tail: list[str] = []
    while alive:
        moved = True
        while moved:
            moved = False
            for n in sorted(x for x in alive if not (out_[x] & alive)):  # sinks: used by nobody left -> last
                tail.append(n)
                alive.discard(n)
                moved = True
            for n in sorted(x for x in alive if not (in_[x] & alive)):  # sources: use nothing left -> first
                head.append(n)
                alive.discard(n)
                moved = True
        if alive:
            n = max(sorted(alive), key=lambda x: len(out_[x] & alive) - len(in_[x] & alive))
            head.append(n)
            alive.discard(n)
    return head + tail[::-1]


def dfs_order(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> list[str]:
    """Seed 004's form: a depth-first post-order over the dependencies (cycles broken where the search meets
    them). For comparison."""
    deps: dict[str, list[str]] = defaultdict(list)
    for a, b in sorted(edges):
        deps[a].append(b)
    seen: set[str] = set()
    order: list[str] = []
    for root in sorted(set(nodes)):
        stack = [(root, iter(deps[root]))]
        if root in seen:
            continue
        seen.add(root)
        while stack:
            n, it = stack[-1]
            nxt = next((m for m in it if m not in seen), None)
            if nxt is None:
                order.append(n)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(deps[nxt])))
    return order


def respected(order: list[str], edges: Iterable[tuple[str, str]]) -> float:
    """The fraction of dependency edges (A uses B) with B placed before A (1.0 without edges)."""
    pos = {n: i for i, n in enumerate(order)}
    es = [(a, b) for a, b in edges if a in pos and b in pos and a != b]
    return sum(pos[b] < pos[a] for a, b in es) / len(es) if es else 1.0


def depsort(sources: Mapping[str, str]) -> tuple[list[str], dict[str, object]]:
    """A repository's files (path -> source) in dependency order, and a report (edges, respected fraction, files
    that do not parse). Non-Python files keep their relative order after the Python ones they do not depend on."""
    py = {p: s for p, s in sources.items() if p.endswith(".py")}
    syms = [symbols(p, s) for p, s in sorted(py.items())]
    edges = dependency_edges(syms)
    order = best_effort_order(py, edges)
    order += sorted(p for p in sources if p not in py)
    return order, {"files": len(sources), "python_files": len(py), "edges": len(edges),
                   "respected": respected(order, edges), "dfs_respected": respected(dfs_order(py, edges), edges),
                   "unparsed": [f.error for f in syms if f.error]}
