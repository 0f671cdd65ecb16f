"""hooks.constructor against real processes: the batches trainers get are the hook applied to the batches of a run
without it (labels masked, a token-aligned field added and cut by context parallelism like input_ids), replay
rebuilds the hooked batch, and a hook that breaks the batch is refused naming the hook, step and field."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from mixplane.checks import default_checks
from mixplane.client import DeliveryError, MixtureLoader
from mixplane.replay import replay_step
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import SpecError, parse_spec
from tests.conftest import fetch_batches, token_mixture

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "strategies" / "loss_only_on.py"
STEPS = 6


def example():
    s = importlib.util.spec_from_file_location("loss_only_on_example", EXAMPLE)
    m = importlib.util.module_from_spec(s)
    s.loader.exec_module(m)
    return m.loss_only_on


def test_the_hooked_batches_are_the_hook_applied_to_the_plain_ones(token_sources, tmp_path):
    doc = token_mixture(token_sources["root"])
    hooked = {**doc, "hooks": {"constructor": {"name": f"{EXAMPLE}:loss_only_on", "options": {"sources": ["b"]},
                                                "token_fields": ["doc_start"]}}}
    with EmbeddedRuntime(parse_spec(doc), tmp_path / "plain") as rt:
        plain = fetch_batches(rt, [0, 1], STEPS)
    run_dir = tmp_path / "hooked"
    spec = parse_spec(hooked, checks=default_checks())
    with EmbeddedRuntime(spec, run_dir) as rt:
        got = fetch_batches(rt, [0, 1], STEPS)
    fn = example()
    masked = 0
    for r in (0, 1):
        for step in range(STEPS):
            a, b = plain[r][step], got[r][step]
            want = fn({k: v for k, v in a.items()}, {"sources": ["a", "b", "c"]}, sources=["b"])
            assert set(b) == set(a) | {"doc_start"}
            for k in want:
                assert np.array_equal(b[k], want[k]), f"rank {r} step {step}: {k}"
            masked += int(((a["labels"] != -100) & (b["labels"] == -100)).sum())
    assert masked > 0  # sources a and c lost their loss
    out = replay_step(spec, step=STEPS - 1, rank=1, run_dir=str(run_dir), save=str(tmp_path / "r.npz"))
    saved = np.load(tmp_path / "r.npz")
    assert out["digest_match"] and np.array_equal(saved["doc_start"], got[1][STEPS - 1]["doc_start"])
    assert np.array_equal(saved["labels"], got[1][STEPS - 1]["labels"])


def test_context_parallelism_cuts_the_hooks_token_field_like_input_ids(token_sources, tmp_path):
    doc = token_mixture(token_sources["root"], topology={"modules": {"backbone": {"dp": 1, "cp": 2}}},
                        hooks={"constructor": {"name": f"{EXAMPLE}:loss_only_on", "options": {"sources": ["a"]},
                                               "token_fields": ["doc_start"]}})
    with EmbeddedRuntime(parse_spec(doc), tmp_path / "cp") as rt:
        got = fetch_batches(rt, [0, 1], 2)
    for r in (0, 1):
        b = got[r][0]
        idx = b["cp_token_index"]
        assert b["doc_start"].shape == b["input_ids"].shape and b["doc_start"].shape[-1] == len(idx)
        # a document starts where its position is 0: the cut kept the field aligned with the tokens
        assert np.array_equal(b["doc_start"] == 1, (b["position_ids"] == 0) & (b["source_ids"] >= 0))


def test_a_hook_that_breaks_the_batch_is_refused_naming_it(token_sources, tmp_path):
    bad = tmp_path / "bad_hook.py"
    bad.write_text("def drop(batch, ctx):\n    return {k: v for k, v in batch.items() if k != 'labels'}\n"
                   "def reshape(batch, ctx):\n    return {**batch, 'labels': batch['labels'][:, :3]}\n")
    for fn, what in (("drop", " dropped field(s) labels"),
                     ("reshape", ": field 'labels' must stay a int64 array of shape (4, 256), got int64 (4, 3)")):
        doc = token_mixture(token_sources["root"], hooks={"constructor": {"name": f"{bad}:{fn}"}})
        with EmbeddedRuntime(parse_spec(doc), tmp_path / fn) as rt:
            loader = MixtureLoader(rt.planner_endpoint, rank=0, max_steps=1, timeout_s=60)
            with pytest.raises(DeliveryError, match=re.escape(f"hooks.constructor '{bad}:{fn}' at step 0 (dp rank 0){what}")):
                next(iter(loader))
            loader.close()
    doc = token_mixture(token_sources["root"], hooks={"constructor": {"name": "nope.py:f"}})
    with pytest.raises(SpecError, match="hooks.constructor.name: no such hook file"):
        parse_spec(doc, checks=default_checks())
    doc = token_mixture(token_sources["root"], hooks={"constructor": {"name": f"{EXAMPLE}:loss_only_on", "options": {"x": 1}}})
    with pytest.raises(SpecError, match="does not accept option.s. x"):
        parse_spec(doc, checks=default_checks())
