"""Depsort (poolside's Model Factory): a repository's Python and JavaScript files in dependency order, so a model sees definitions
before their uses. Pure (no I/O): Python through `ast`, JavaScript through tree-sitter's parser (the `prep` extra).

The graph: file A depends on file B when A imports B's module (``import pkg.b``, ``from pkg.b import x``,
relative ``from . import b`` / ``from .b import x``) or imports a name from a package that B defines
(``from pkg import name`` with ``name`` defined in ``pkg/__init__.py``, or ``pkg/name.py``). Symbols come from
the syntax tree, not from text search. A file that does not parse keeps its place and no edges (its name is
reported).

JavaScript (``.js``, ``.mjs``, ``.cjs``, ``.jsx``): file A depends on file B when A imports B by a relative
specifier -- ``import ... from './b'``, ``export ... from './b'``, ``require('./b')``, ``import('./b')`` -- resolved as
Node resolves a relative path (``./b`` is ``b.js`` (or another suffix above) or ``b/index.js``). Bare specifiers
(``react``) name packages outside the repository and make no edge. The names a file defines (top-level functions,
classes, declarations, exports) are kept beside, as for Python. Edges never cross languages.

The order: repositories have import cycles, so a strict topological order may not exist. poolside's pipeline breaks cycles
where a depth-first search happens to meet them; here the order is the Eades-Lin-Smyth heuristic for the
minimum feedback arc set (sinks first, sources last, then the node with the largest out-minus-in degree), which
keeps more dependency edges than an arbitrary break: every edge of an acyclic graph, and on cyclic ones at least
half of them. Ties go by path, so the order is deterministic.
"""

from __future__ import annotations

import ast
from collections import defaultdict
import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

JS_SUFFIXES = (".js", ".mjs", ".cjs", ".jsx")


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


def is_javascript(path: str) -> bool:
    return path.endswith(JS_SUFFIXES)


def _js_module(path: str) -> str:
    """A JavaScript file's key for resolution: its normalised path without the suffix."""
    p = posixpath.normpath(path.replace("\\", "/"))
    return next((p[: -len(x)] for x in JS_SUFFIXES if p.endswith(x)), p)


def _js_parser() -> Any:
    try:
        import tree_sitter
        import tree_sitter_javascript
    except ImportError as e:  # the prep extra
        raise ImportError(f"depsort of JavaScript needs tree-sitter (pip install 'mixplane[prep]'): {e}") from None
    return tree_sitter.Parser(tree_sitter.Language(tree_sitter_javascript.language()))


def _string_value(node: Any) -> str | None:
    if node is None or node.type != "string":
        return None
    return "".join(c.text.decode() for c in node.children if c.type == "string_fragment")


def js_symbols(path: str, source: str, parser: Any = None) -> FileSymbols:
    """What one JavaScript file defines (top level) and which repository files it imports by a relative specifier
    (`imports`: the candidates' module keys, ``dir/b`` and ``dir/b/index``); a file with syntax errors: `error`."""
    out = FileSymbols(path, _js_module(path))
    tree = (parser or _js_parser()).parse(source.encode("utf-8", "surrogatepass"))
    root = tree.root_node
    if root.has_error:
        first = next((n for n in _walk(root) if n.type == "ERROR" or n.is_missing), root)
        out.error = f"{path}: syntax error at line {first.start_point[0] + 1}"
        return out
    here = posixpath.dirname(out.module)
    for node in root.children:  # top level: what other files can import
        decl = node.child_by_field_name("declaration") if node.type == "export_statement" else node
        if decl is None:
            continue
        if decl.type in ("function_declaration", "generator_function_declaration", "class_declaration"):
            name = decl.child_by_field_name("name")
            if name is not None:
                out.defines.add(name.text.decode())
        elif decl.type in ("lexical_declaration", "variable_declaration"):
            for d in decl.children:
                name = d.child_by_field_name("name") if d.type == "variable_declarator" else None
                if name is not None and name.type == "identifier":
                    out.defines.add(name.text.decode())
    for node in _walk(root):
        spec = None
        if node.type in ("import_statement", "export_statement"):
            spec = _string_value(node.child_by_field_name("source"))
        elif node.type == "call_expression":
            fn, args = node.child_by_field_name("function"), node.child_by_field_name("arguments")
            if fn is not None and fn.type in ("identifier", "import") and fn.text in (b"require", b"import") \
                    and args is not None and args.named_child_count == 1:
                spec = _string_value(args.named_children[0])
        if spec and spec.startswith((".", "/")):
            target = _js_module(posixpath.normpath(posixpath.join(here, spec)) if spec.startswith(".") else spec[1:])
            out.imports.update({target, f"{target}/index"})
    return out


def _walk(node: Any) -> Iterable[Any]:
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(n.children))


def js_dependency_edges(files: Iterable[FileSymbols]) -> set[tuple[str, str]]:
    """(A, B) for every JavaScript file A that imports file B of the same repository (paths; no self edges)."""
    fs = list(files)
    by_module = {f.module: f.path for f in fs}
    return {(f.path, by_module[m]) for f in fs for m in f.imports if m in by_module and by_module[m] != f.path}


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
    """poolside's form: a depth-first post-order over the dependencies (cycles broken where the search meets
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
    that do not parse). Python and JavaScript files are ordered together by their edges (none cross languages);
    other files follow in path order."""
    py = {p: s for p, s in sources.items() if p.endswith(".py")}
    js = {p: s for p, s in sources.items() if is_javascript(p)}
    syms = [symbols(p, s) for p, s in sorted(py.items())]
    parser = _js_parser() if js else None
    js_syms = [js_symbols(p, s, parser) for p, s in sorted(js.items())]
    edges = dependency_edges(syms) | js_dependency_edges(js_syms)
    code = [*py, *js]
    order = best_effort_order(code, edges)
    order += sorted(p for p in sources if p not in py and p not in js)
    return order, {"files": len(sources), "python_files": len(py), "javascript_files": len(js), "edges": len(edges),
                   "respected": respected(order, edges), "dfs_respected": respected(dfs_order(code, edges), edges),
                   "unparsed": [f.error for f in [*syms, *js_syms] if f.error]}
