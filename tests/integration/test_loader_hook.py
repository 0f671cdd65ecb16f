"""hooks.loader against real processes: the hook runs in the loader processes on their part of every step's plan,
decides the order they gather and serve the spans (and their read-ahead), and the batches trainers get are those
of a run without it; the journal records it (the open record's spec); a hook whose result is no way to consume
the plan stops the loader naming the hook, step, source and field; a bad name or option is refused at validation."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from mixplane.checks import default_checks
from mixplane.client import DeliveryError, MixtureLoader
from mixplane.planner import journal
from mixplane.runtime import ComponentFailed, EmbeddedRuntime
from mixplane.spec import SpecError, parse_spec
from tests.conftest import fetch_batches, token_mixture

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "strategies" / "busiest_first.py"
STEPS = 5

RECORDER = f'''
import importlib.util, json, os
_s = importlib.util.spec_from_file_location("busiest_first_example", {str(EXAMPLE)!r})
_m = importlib.util.module_from_spec(_s)
_s.loader.exec_module(_m)

def record(plan, ctx, log, read_ahead_steps=0):
    out = _m.busiest_first(plan, ctx, read_ahead_steps=read_ahead_steps)
    with open(log, "a") as f:
        f.write(json.dumps({{"pid": os.getpid(), "step": ctx["step"], "source": ctx["source"],
                            "replica": ctx["replica"], "constructors": ctx["constructors"],
                            "dest": plan["dest"].tolist(), "len": plan["len"].tolist(), "key": plan["key"].tolist(),
                            "order": out["order"].tolist(), "read_ahead_before": ctx["read_ahead_tokens"],
                            "read_ahead": out.get("read_ahead_tokens")}}) + "\\n")
    return out

def shuffle_keys(plan, ctx):
    return {{"order": list(range(len(plan["pos"])))[::-1] + [0]}}
'''


def test_the_hook_runs_in_the_loaders_and_orders_what_they_serve_without_changing_a_batch(token_sources, tmp_path):
    rec = tmp_path / "recorder.py"
    rec.write_text(RECORDER)
    log = tmp_path / "calls.jsonl"
    doc = token_mixture(token_sources["root"])
    with EmbeddedRuntime(parse_spec(doc), tmp_path / "plain") as rt:
        plain = fetch_batches(rt, [0, 1], STEPS)
    hooked = {**doc, "hooks": {"loader": {"name": f"{rec}:record", "sources": ["a", "b"],
                                          "options": {"log": str(log), "read_ahead_steps": 3}}}}
    run_dir = tmp_path / "hooked"
    spec = parse_spec(hooked, checks=default_checks())
    with EmbeddedRuntime(spec, run_dir) as rt:
        got = fetch_batches(rt, [0, 1], STEPS)
        pids = {name: info["pid"] for name, info in rt.endpoints()["components"].items()}
    for r in (0, 1):
        for step in range(STEPS):
            assert set(got[r][step]) == set(plain[r][step])
            for k, v in plain[r][step].items():
                assert np.array_equal(got[r][step][k], v), f"rank {r} step {step}: {k}"
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    loader_pids = {p for name, p in pids.items() if name.startswith("loader")}
    assert calls and {c["pid"] for c in calls} <= loader_pids and os.getpid() not in {c["pid"] for c in calls}
    assert {c["source"] for c in calls} == {"a", "b"}  # hooks.loader.sources: c's loader runs no hook
    for c in calls:
        assert sorted(c["order"]) == list(range(len(c["dest"])))
    # what it changed: some step's spans served in another order than planned, the busiest constructor first
    changed = [c for c in calls if c["order"] != sorted(c["order"])]
    assert changed
    for c in calls:
        served = [c["dest"][i] for i in c["order"]]
        tokens = np.bincount(c["dest"], weights=c["len"], minlength=c["constructors"])
        firsts = list(dict.fromkeys(served))
        assert [tokens[d] for d in firsts] == sorted((tokens[d] for d in firsts), reverse=True)
    # and its read-ahead hint: the next call sees the read-ahead the previous one asked for
    by_loader: dict[tuple[str, int], list[dict]] = {}
    for c in calls:
        by_loader.setdefault((c["source"], c["replica"]), []).append(c)
    for seq in by_loader.values():
        for prev, nxt in zip(seq, seq[1:]):
            assert nxt["read_ahead_before"] == prev["read_ahead"]
    opened = [r for r in journal.read_journal(run_dir / "journal.jsonl") if r["event"] == "open"]
    assert opened and opened[-1]["spec"]["hooks"]["loader"]["name"] == f"{rec}:record"


def test_a_hook_whose_order_is_no_permutation_stops_the_loader_naming_it(token_sources, tmp_path):
    rec = tmp_path / "recorder.py"
    rec.write_text(RECORDER)
    doc = token_mixture(token_sources["root"], hooks={"loader": {"name": f"{rec}:shuffle_keys", "sources": ["a"]}})
    with EmbeddedRuntime(parse_spec(doc), tmp_path / "bad") as rt:
        loader = MixtureLoader(rt.planner_endpoint, rank=0, max_steps=1, timeout_s=10)
        with pytest.raises(DeliveryError, match="step 0 not delivered"):  # the step never comes: a's loader stopped rather than serve it otherwise
            next(iter(loader))
        loader.close()
        with pytest.raises(ComponentFailed, match="loader.* exited with code 2"):
            for _ in range(100):
                rt.supervise()
                time.sleep(0.2)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "bad" / "logs").glob("loader*.log"))
    assert re.search(rf"hooks.loader '{re.escape(str(rec))}:shuffle_keys' at step 0 \(source 'a', replica 0\): "
                     r"field 'order' must be a permutation of the step's \d+ planned span\(s\)", logs), logs[-2000:]


def test_a_hook_that_does_not_load_or_refuses_its_options_is_refused_at_validation(token_sources, tmp_path):
    for hook, what in (({"name": "nope.py:f"}, "hooks.loader.name: no such hook file"),
                       ({"name": f"{EXAMPLE}:busiest_first", "options": {"x": 1}}, "hooks.loader.name: .*does not accept option.s. x"),
                       ({"name": f"{EXAMPLE}:nothing_here"}, "hooks.loader.name: hooks.loader .*cannot import"),
                       ({"name": f"{EXAMPLE}:busiest_first", "sources": ["zz"]}, r"hooks.loader.sources\[0\]: unknown source 'zz'")):
        doc = token_mixture(token_sources["root"], hooks={"loader": hook})
        with pytest.raises(SpecError, match=what):
            parse_spec(doc, checks=default_checks())


def test_a_run_with_the_hook_resumes_exactly_where_the_plain_run_is(token_sources, tmp_path):
    """The hook orders what a loader serves, never what it reads past or where its cursor stands: a hooked run saved
    at a step and resumed in a new runtime delivers what the plain run delivered from there."""
    from tests.integration.test_runtime import fetch as threaded_fetch

    doc = token_mixture(token_sources["root"])
    hooked = {**doc, "hooks": {"loader": {"name": f"{EXAMPLE}:busiest_first", "options": {"read_ahead_steps": 2}}}}
    with EmbeddedRuntime(parse_spec(doc), tmp_path / "plain") as rt:
        plain = threaded_fetch(rt.planner_endpoint, 2, 8)
    states: dict = {"at": 3}
    with EmbeddedRuntime(parse_spec(hooked), tmp_path / "first") as rt:
        threaded_fetch(rt.planner_endpoint, 2, 8, states=states)
    with EmbeddedRuntime(parse_spec(hooked), tmp_path / "resumed") as rt:
        resumed = threaded_fetch(rt.planner_endpoint, 2, 8, start=states["saved"])
    for r in (0, 1):
        assert [int(b["step"]) for b in resumed[r]] == list(range(4, 8))
        for a, b in zip(plain[r][4:], resumed[r]):
            assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
