"""mixplane.prep's pure rules: weighted MinHash estimates weighted Jaccard, LSH banding for a threshold, the greedy
vertex cover (and its metadata preference), depsort's dependency graph and best-effort order."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mixplane.prep.depsort import best_effort_order, dependency_edges, depsort, dfs_order, respected, symbols
from mixplane.prep.graph import is_vertex_cover, vertex_cover
from mixplane.prep.minhash import (collision, estimate, lsh_params, signature, token_id, tokens, weighted_bag,
                                   weighted_jaccard)


def bag(rng, n=300, vocab=5000):
    ids = rng.choice(vocab, size=n, replace=False).astype(np.int64)
    return ids, rng.uniform(0.2, 5.0, n)


def test_weighted_minhash_estimates_the_weighted_jaccard_similarity():
    rng = np.random.default_rng(0)
    errs = []
    for keep in (0.1, 0.4, 0.7, 0.9, 1.0):
        a = bag(rng)
        ids, w = a[0].copy(), a[1].copy()
        change = rng.random(len(ids)) > keep
        ids[change] = rng.integers(10_000, 20_000, change.sum())  # other tokens
        w = np.where(rng.random(len(w)) < 0.3, w * rng.uniform(0.5, 2.0, len(w)), w)  # and other weights
        b = (ids, w)
        J = weighted_jaccard(a, b)
        est = estimate(signature(*a, 512, seed=3), signature(*b, 512, seed=3))
        errs.append(abs(est - J))
        assert abs(est - J) < 0.07, (keep, J, est)  # 512 hashes: sd <= 0.022
    assert np.mean(errs) < 0.03
    a = bag(rng)
    s1 = signature(*a, 64, seed=9)
    perm = rng.permutation(len(a[0]))
    assert np.array_equal(s1, signature(a[0][perm], a[1][perm], 64, seed=9))  # order of the bag does not matter
    assert not np.array_equal(s1, signature(*a, 64, seed=10))
    assert estimate(s1, signature(a[0], a[1] * 1.0000001, 64, seed=9)) > 0.9
    assert np.array_equal(signature(np.zeros(0, np.int64), np.zeros(0), 8), np.zeros(8, np.uint64))


def test_bags_weigh_rare_tokens_up_and_code_keeps_punctuation():
    assert tokens("Hello, World; x=1") == ["hello", "world", "x", "1"]
    assert tokens("def f(x): return x;", code=True) == ["def", "f", "(", "x", ")", ":", "return", "x", ";"]
    assert token_id("x") == token_id("x") != token_id("y") and 0 <= token_id("x") < 1 << 63
    ids, w = weighted_bag(["a", "a", "b"], df={token_id("a"): 100, token_id("b"): 1}, n_docs=100)
    by = dict(zip(ids.tolist(), w.tolist()))
    assert by[token_id("a")] == pytest.approx(2 * np.log1p(1.0)) and by[token_id("b")] == pytest.approx(np.log1p(100.0))


def test_lsh_parameters_put_the_collision_curve_s_step_at_the_threshold():
    prev_rows = 0
    for th in (0.5, 0.7, 0.9):
        b, r = lsh_params(th, 128)
        assert b * r <= 128 and r >= prev_rows
        prev_rows = r
        assert collision(th - 0.25, b, r) < 0.5 < collision(min(th + 0.08, 0.99), b, r)
    with pytest.raises(ValueError, match="threshold"):
        lsh_params(1.0, 64)


def test_the_vertex_cover_keeps_an_independent_set_and_prefers_to_drop_forks():
    assert vertex_cover([("hub", x) for x in "abcd"]) == {"hub"}  # the leaves are not similar to each other: kept
    assert vertex_cover([(1, 2), (2, 3)]) == {2}
    assert vertex_cover([(1, 1)]) == set()
    rng = random.Random(4)
    for _ in range(50):
        nodes = list(range(rng.randint(2, 30)))
        edges = {tuple(sorted(rng.sample(nodes, 2))) for _ in range(rng.randint(1, 60))}
        c = vertex_cover(edges)
        assert is_vertex_cover(edges, c) and c == vertex_cover(sorted(edges, reverse=True))
        kept = set(nodes) - c
        assert not any(u in kept and v in kept for u, v in edges)
    # repository level: the original has the most similar repositories (its forks), yet the forks go
    edges = [("orig", "fork1"), ("orig", "fork2"), ("orig", "other")]
    pref = {"fork1": (0, 1.0), "fork2": (0, 5.0), "orig": (1, 900.0), "other": (1, 3.0)}
    assert vertex_cover(edges, pref) == {"fork1", "fork2", "other"}
    assert vertex_cover(edges) == {"orig"}


REPO = {
    "pkg/__init__.py": "from .core import Engine\n__all__ = ['Engine']\n",
    "pkg/util.py": "def helper():\n    return 1\n",
    "pkg/core.py": "from pkg.util import helper\nfrom . import models\nclass Engine:\n    pass\n",
    "pkg/models.py": "import pkg.util\nMODEL = 1\n",
    "app.py": "from pkg import Engine\nimport json\n",
    "tests/test_app.py": "import app\n",
    "README.md": "# a repo\n",
}


def test_depsort_orders_definitions_before_uses():
    syms = {p: symbols(p, s) for p, s in REPO.items() if p.endswith(".py")}
    assert syms["pkg/core.py"].defines == {"Engine"} and ("pkg", "models") in syms["pkg/core.py"].from_imports
    assert syms["pkg/__init__.py"].module == "pkg" and "pkg.core" in syms["pkg/__init__.py"].imports
    edges = dependency_edges(syms.values())
    assert ("pkg/core.py", "pkg/util.py") in edges and ("pkg/core.py", "pkg/models.py") in edges
    assert ("app.py", "pkg/__init__.py") in edges and ("tests/test_app.py", "app.py") in edges
    order, report = depsort(REPO)
    pos = {p: i for i, p in enumerate(order)}
    assert pos["pkg/util.py"] < pos["pkg/core.py"] < pos["app.py"] < pos["tests/test_app.py"]
    assert order[-1] == "README.md" and report["unparsed"] == []
    # pkg/__init__ imports core and core's `from . import models` imports pkg: a cycle, one edge of it given up
    assert 0.8 <= report["respected"] < 1.0
    bad, rep = depsort({"a.py": "def (:\n", "b.py": "import a\n"})
    assert set(bad) == {"a.py", "b.py"} and rep["unparsed"] and rep["unparsed"][0].startswith("a.py: SyntaxError")


JS_REPO = {
    "src/util.js": "export function helper() { return 1 }\nexport const K = 2;\n",
    "src/core.js": "import { helper } from './util.js';\nconst models = require('./models');\nexport class Engine {}\n",
    "src/models/index.js": "export default 1;\nimport('../util').then((u) => u.helper());\n",
    "app.mjs": "import { Engine } from './src/core'\nimport React from 'react'\nexport { K } from './src/util.js'\n",
    "tool.py": "import json\n",
    "notes.txt": "x",
}


def test_depsort_orders_javascript_by_its_relative_imports():
    from mixplane.prep.depsort import js_dependency_edges, js_symbols

    core = js_symbols("src/core.js", JS_REPO["src/core.js"])
    assert core.defines == {"Engine", "models"} and {"src/util", "src/models", "src/models/index"} <= core.imports
    syms = [js_symbols(p, s) for p, s in JS_REPO.items() if p.endswith((".js", ".mjs"))]
    assert js_dependency_edges(syms) == {("src/core.js", "src/util.js"), ("src/core.js", "src/models/index.js"),
                                         ("src/models/index.js", "src/util.js"), ("app.mjs", "src/core.js"),
                                         ("app.mjs", "src/util.js")}  # 'react' is not in the repository
    order, report = depsort(JS_REPO)
    pos = {p: i for i, p in enumerate(order)}
    assert pos["src/util.js"] < pos["src/models/index.js"] < pos["src/core.js"] < pos["app.mjs"]
    assert order[-1] == "notes.txt" and report["javascript_files"] == 4 and report["respected"] == 1.0
    assert report["edges"] == 5 and report["python_files"] == 1
    bad, rep = depsort({"a.js": "function (( {", "b.js": "import './a.js'"})
    assert set(bad) == {"a.js", "b.js"} and rep["unparsed"] == ["a.js: syntax error at line 1"]


def test_best_effort_order_keeps_every_edge_of_a_dag_and_at_least_half_otherwise():
    rng = random.Random(7)
    for _ in range(40):
        n = rng.randint(2, 25)
        nodes = [f"f{i}" for i in range(n)]
        dag = {(nodes[i], nodes[j]) for i in range(n) for j in range(i) if rng.random() < 0.2}  # i uses j < i
        assert respected(best_effort_order(nodes, dag), dag) == 1.0
        cyc = dag | {(b, a) for a, b in sorted(dag)[: rng.randint(0, 5)]}
        o = best_effort_order(nodes, cyc)
        assert sorted(o) == sorted(nodes) and respected(o, cyc) >= 0.5
        assert respected(dfs_order(nodes, dag), dag) == 1.0  # the seed's DFS is exact on a DAG too
