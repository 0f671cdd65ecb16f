"""A source that ends (max_epochs) and a source weighted by rows per step (mixture.rows), through the embedded
runtime: the trainer gets every row of the capped source's two passes exactly once and nothing of it after the step
it ended in, the rows source begins exactly its documents every step, the end is journaled and in STATUS, and a
resume from before the end and a replay after it are bit-exact. docs/mixtures.md."""

from __future__ import annotations

import json

import numpy as np

from mixplane.client import MixtureLoader
from mixplane.replay import replay_step
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.conftest import token_mixture, write_token_source

STEPS = 18


def batches(loader: MixtureLoader) -> list[dict[str, np.ndarray]]:
    out = [{k: v.numpy().copy() for k, v in b.items() if k in ("input_ids", "source_ids", "labels")} for b in loader]
    loader.close()
    return out


def test_an_ended_source_and_a_rows_source_are_exact_resumable_and_replayable(token_sources, tmp_path):
    small = write_token_source(tmp_path / "small", rows=60, files=1, mean_len=60, seed=11, rows_per_group=20)
    doc = token_mixture(token_sources["root"], topology={"modules": {"backbone": {"dp": 1}}})
    doc["sources"] = [doc["sources"][0], doc["sources"][1],
                      {"name": "small", "uri": str(tmp_path / "small"), "kind": "tokens", "columns": ["tokens"],
                       "shuffle": "page", "max_epochs": 2}]
    doc["mixture"] = {"weights": {"a": 0.6, "small": 0.4}, "rows": {"b": 2}, "seed": 7}
    spec = parse_spec(doc)
    run_dir = tmp_path / "run"
    with EmbeddedRuntime(spec, run_dir) as rt:
        ref = batches(MixtureLoader(rt.planner_endpoint, rank=0, max_steps=STEPS, timeout_s=90))
        status = rt.status()
        records = [json.loads(line) for line in (run_dir / "journal.jsonl").read_text().splitlines()]
        steps = {r["step"]: r for r in records if r["event"] == "step"}
        ended = [s for s, r in sorted(steps.items()) if r.get("ended")]
        assert len(ended) == 1 and steps[ended[0]]["ended"] == ["small"]
        end = ended[0]
        assert 2 <= end < STEPS - 3, end
        assert status["ended"] == {"small": end} and status["halted"] is None

        # b: exactly 2 documents begin in every step; small: every token of its two passes, none after the end
        assert all(steps[s]["samples"][1] == 2 for s in range(STEPS))
        small_tokens = [int((b["source_ids"] == 2).sum()) for b in ref]
        assert sum(small_tokens) == 2 * sum(len(d) for d in small)
        assert small_tokens[end] > 0 and not any(small_tokens[end + 1:])
        assert [steps[s]["tokens"][2] for s in range(STEPS)] == small_tokens  # the journal says what was delivered

        # resume from the state two steps before the end: the same batches, the end at the same step
        resume_at = end - 2
        probe = MixtureLoader(rt.planner_endpoint, rank=0, max_steps=resume_at, timeout_s=90)
        for _ in probe:
            pass
        state = probe.state_dict()
        probe.close()
        again = MixtureLoader(rt.planner_endpoint, rank=0, max_steps=STEPS, timeout_s=90)
        again.load_state_dict(state)
        rest = batches(again)
        assert len(rest) == STEPS - resume_at
        for s, (x, y) in enumerate(zip(rest, ref[resume_at:]), start=resume_at):
            assert np.array_equal(x["input_ids"], y["input_ids"]) and np.array_equal(x["source_ids"], y["source_ids"]), s
    for step in (end, end + 2):
        out = replay_step(spec, step=step, rank=0, run_dir=str(run_dir), save=str(tmp_path / f"r{step}.npz"))
        assert out["digest_match"]
        assert np.array_equal(np.load(tmp_path / f"r{step}.npz")["input_ids"], ref[step]["input_ids"])


def test_when_every_share_source_has_ended_the_planner_stops_and_says_why(token_sources, tmp_path):
    import pytest

    from mixplane.client import DeliveryError

    small = write_token_source(tmp_path / "small", rows=40, files=1, mean_len=80, seed=12, rows_per_group=20)
    doc = token_mixture(token_sources["root"], topology={"modules": {"backbone": {"dp": 1}}})
    doc["sources"] = [doc["sources"][0], {"name": "small", "uri": str(tmp_path / "small"), "kind": "tokens",
                                          "columns": ["tokens"], "shuffle": "page", "oversample": False}]
    doc["mixture"] = {"weights": {"a": 0.0, "small": 1.0}, "seed": 7}
    spec = parse_spec(doc)
    run_dir = tmp_path / "run"
    got = []
    with EmbeddedRuntime(spec, run_dir) as rt:
        loader = MixtureLoader(rt.planner_endpoint, rank=0, max_steps=30, timeout_s=8)
        with pytest.raises(DeliveryError, match="not delivered"):
            for b in loader:
                got.append(b["source_ids"].numpy().copy())
        loader.close()
        status = rt.status()
    end = status["ended"]["small"]
    assert len(got) == end + 1  # the step it ended in is delivered; none after it
    assert sum(int((s == 1).sum()) for s in got) == sum(len(d) for d in small)  # one pass, every token once
    assert status["halted"] == f"step {end + 1}: every source with a share weight has ended: small (step {end})"
    assert status["planned_through"] == end
