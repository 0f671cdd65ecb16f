"""Sources that end (max_epochs, oversample: false) and sources weighted by rows per step (mixture.rows):
exact per step, the end recorded, resume from any cursor plans the same steps. docs/mixtures.md."""

from __future__ import annotations

import numpy as np
import pytest

from mixplane.layout import layout_digest
from mixplane.mixing import SourcesExhausted
from mixplane.planner.core import RowsShortError, StepPlanner
from mixplane.samples import key_epoch, key_row, make_key
from mixplane.spec import SpecError, epoch_caps, parse_spec

from .planner_helpers import fill

EPOCH_ROWS = {0: 40, 1: 5000, 2: 5000, 3: 30}  # rows of each source (one pass)
MEANS = {0: 90, 1: 60, 2: 150, 3: 40}


def meta(source: int, replica: int, pos: np.ndarray, seq_len: int):
    """A static source of EPOCH_ROWS[source] rows read pass after pass (a new order each pass does not matter
    here): position p is row p % rows of pass p // rows; a row has the same length in every pass."""
    n = EPOCH_ROWS[source]
    row = pos % n
    tok = np.array([int(np.random.default_rng([source, int(r)]).integers(MEANS[source] // 4, MEANS[source] * 2)) + 1
                    for r in row], np.int64)
    return np.asarray(make_key(pos // n, row), np.int64), tok, np.zeros(len(pos), np.int64)


def spec(*, a: dict | None = None, mixture: dict | None = None, sources: int = 3, seq_len: int = 256, rows: int = 8):
    srcs = [{"name": n, "uri": f"/x/{n}", "kind": "tokens", "columns": ["t"]} for n in "abcd"[:sources]]
    srcs[0].update(a or {})
    return parse_spec({
        "sources": srcs, "mixture": mixture or {"weights": {"a": 0.5, "b": 0.3, "c": 0.2}},
        "batch": {"sequences": rows, "seq_len": seq_len, "microbatches": 2},
        "topology": {"modules": {"backbone": {"dp": 2}}}, "strategy": {"name": "vanilla"}, "runtime": {"window": 16},
    })


def plan_steps(planner: StepPlanner, steps: int) -> list:
    out = []
    for _ in range(steps):
        fill(planner, meta=meta)
        out.append(planner.plan())
    return out


def whole_samples(plan, source: int) -> list[int]:
    """Keys of the source's samples whose last piece is in this step (start + length == tokens)."""
    p = plan.pieces
    return sorted(p.key[(p.source == source)].tolist())


def test_epoch_caps_is_the_one_rule():
    assert epoch_caps(spec()) == [None, None, None]  # default: a static source wraps without limit (as before)
    assert epoch_caps(spec(a={"oversample": False})) == [1, None, None]
    assert epoch_caps(spec(a={"max_epochs": 3})) == [3, None, None]
    assert epoch_caps(spec(a={"oversample": True, "max_epochs": 2})) == [2, None, None]
    assert epoch_caps(spec(a={"oversample": False, "max_epochs": 1})) == [1, None, None]


def test_a_capped_source_delivers_each_row_of_its_passes_once_then_ends_exactly():
    planner = StepPlanner(spec(a={"max_epochs": 2}))
    plans = plan_steps(planner, 40)
    ended = [(pl.layout.step, pl.ended) for pl in plans if pl.ended]
    assert len(ended) == 1 and ended[0][1] == ("a",)
    end = ended[0][0]
    assert planner.schedule.ended == {"a": end}
    # every row of both passes of `a`, each exactly once, whole; nothing of a third pass; nothing after the end
    got: dict[int, int] = {}
    for pl in plans:
        p = pl.pieces
        m = p.source == 0
        for k, ln in zip(p.key[m].tolist(), p.length[m].tolist()):
            got[k] = got.get(k, 0) + ln
        if pl.layout.step > end:
            assert not m.any(), f"step {pl.layout.step}: source a after its end at step {end}"
    want = {int(make_key(e, r)): int(meta(0, 0, np.array([e * 40 + r]), 256)[1][0]) for e in range(2) for r in range(40)}
    assert got == want
    keys = np.array(sorted(got), np.int64)
    assert set(key_epoch(keys).tolist()) == {0, 1} and len(set(key_row(keys).tolist())) == 40
    # the rows stay as full as without an end (best fit: ~94-99 % here): what `a` no longer gives, b and c take,
    # in the step it ended in too
    for pl in plans:
        assert int(pl.tokens_by_source.sum()) >= 0.9 * 8 * 256, pl.layout.step
    # after the end, b and c share the step 0.3 : 0.2 (renormalised: 0.6 / 0.4), within one sample per prefix
    after = [pl for pl in plans if pl.layout.step > end]
    tok = np.sum([pl.tokens_by_source for pl in after], axis=0)
    assert tok[0] == 0
    assert abs(tok[1] / tok[1:].sum() - 0.6) < 0.03
    point = planner.schedule.at(end + 1)
    assert point.probs[0] == 0 and np.isclose(point.probs[1], 0.6) and point.segment_start == end


def test_oversample_false_is_one_pass():
    planner = StepPlanner(spec(a={"oversample": False}))
    plans = plan_steps(planner, 20)
    keys = np.concatenate([pl.pieces.key[pl.pieces.source == 0] for pl in plans])
    assert set(key_epoch(keys).tolist()) == {0}
    assert len(set(keys.tolist())) == 40
    assert [pl.ended for pl in plans if pl.ended] == [("a",)]


def test_without_a_cap_a_source_wraps_as_before():
    plans = plan_steps(StepPlanner(spec()), 20)
    keys = np.concatenate([pl.pieces.key[pl.pieces.source == 0] for pl in plans])
    assert int(key_epoch(keys).max()) >= 2 and not any(pl.ended for pl in plans)


def test_resume_from_any_cursor_around_the_end_plans_the_same_steps():
    s = spec(a={"max_epochs": 2})
    first = StepPlanner(s)
    plans = plan_steps(first, 30)
    end = next(pl.layout.step for pl in plans if pl.ended)
    for at in (end - 1, end, end + 1, end + 3):
        again = StepPlanner(s)
        again.restore(plans[at].cursor_before)
        replanned = plan_steps(again, 30 - at)
        assert [layout_digest(p.layout) for p in replanned] == [layout_digest(p.layout) for p in plans[at:]], at
        assert [p.ended for p in replanned] == [p.ended for p in plans[at:]]
        assert again.schedule.ended == first.schedule.ended
    # the cursor after the end carries it
    assert plans[end + 1].cursor_before["schedule"]["ended"] == {"a": end}
    assert "ended" not in plans[end].cursor_before["schedule"]


def test_every_share_source_ended_stops_planning_with_the_reason():
    s = spec(a={"max_epochs": 1}, mixture={"weights": {"a": 1.0, "b": 0.0, "c": 0.0}})
    planner = StepPlanner(s)
    with pytest.raises(SourcesExhausted, match=r"every source with a share weight has ended: a \(step \d+\)"):
        plan_steps(planner, 50)
    step = planner.next_step
    with pytest.raises(SourcesExhausted):  # again the same: nothing changed
        plan_steps(planner, 1)
    assert planner.next_step == step


def test_rows_per_step_begin_exactly_that_many_documents_every_step():
    s = spec(sources=4, mixture={"weights": {"a": 0.5, "b": 0.3, "c": 0.2}, "rows": {"d": 3}})
    planner = StepPlanner(s)
    plans = plan_steps(planner, 25)
    for pl in plans:
        assert pl.samples_by_source[3] == 3, pl.layout.step
        assert int(pl.tokens_by_source.sum()) >= 0.9 * 8 * 256
    keys = np.concatenate([pl.pieces.key[(pl.pieces.source == 3) & (pl.pieces.start == 0)] for pl in plans])
    assert len(keys) == 75 and len(set(keys.tolist())) == 75  # in stream order, none twice (30 rows a pass)
    # the share sources divide the rest 0.5 : 0.3 : 0.2
    tok = np.sum([pl.tokens_by_source for pl in plans], axis=0)
    assert abs(tok[0] / tok[:3].sum() - 0.5) < 0.03


def test_a_rows_source_with_a_cap_ends_and_the_steps_go_on():
    s = spec(sources=4, a={}, mixture={"weights": {"a": 0.5, "b": 0.3, "c": 0.2}, "rows": {"d": 4}})
    doc = s.model_dump(mode="json")
    doc["sources"][3]["oversample"] = False
    planner = StepPlanner(parse_spec(doc))
    plans = plan_steps(planner, 12)
    counts = [int(pl.samples_by_source[3]) for pl in plans]
    assert counts[:7] == [4] * 7 and counts[7] == 2 and counts[8:] == [0] * 4  # 30 rows: 7 x 4 + 2
    assert [pl.layout.step for pl in plans if pl.ended == ("d",)] == [7]
    assert all(int(pl.tokens_by_source.sum()) >= 0.9 * 8 * 256 for pl in plans)


def test_rows_that_do_not_fit_are_an_error_naming_step_and_source():
    s = spec(sources=4, seq_len=64, rows=4, mixture={"weights": {"a": 1.0}, "rows": {"d": 60}})
    planner = StepPlanner(s)
    with pytest.raises(RowsShortError, match=r"step 0: source 'd' is weighted by 60 rows per step \(mixture.rows.d\)"):
        plan_steps(planner, 1)


@pytest.mark.parametrize("source, mixture, path", [
    ({"live": True, "oversample": True}, None, "sources[0].oversample"),
    ({"live": True, "max_epochs": 2}, None, "sources[0].max_epochs"),
    ({"oversample": False, "max_epochs": 3}, None, "sources[0].max_epochs"),
    ({"max_epochs": 0}, None, "sources[0].max_epochs"),
    ({}, {"rows": {"x": 2}}, "mixture.rows.x"),
    ({}, {"rows": {"b": 0}}, "mixture.rows.b"),
    ({}, {"weights": {"a": 1, "b": 1}, "rows": {"b": 2}}, "mixture.weights.b"),
    ({}, {"rows": {"b": 2}, "phases": [{"start_step": 5, "weights": {"b": 0.5}}]}, "mixture.phases[0].weights.b"),
    ({}, {"rows": {"a": 1, "b": 1, "c": 1}}, "mixture.rows"),
    ({}, {"rows": {"b": 40000}}, "mixture.rows.b"),
    ({}, {"rows": {"b": 2}, "adaptive": {"every_steps": 10}}, "mixture.rows"),
])
def test_bad_specs_name_the_field(source, mixture, path):
    src = {"name": "a", "uri": "/x/a", "kind": "tokens", "columns": ["t"], **source}
    doc = {"sources": [src] + [{"name": n, "uri": f"/x/{n}", "kind": "tokens", "columns": ["t"]} for n in "bc"],
           "mixture": mixture or {}, "batch": {"sequences": 8, "seq_len": 256}}
    with pytest.raises(SpecError) as e:
        parse_spec(doc)
    assert path in [p.path for p in e.value.problems], e.value


def test_rows_sources_take_no_share_by_default_and_cannot_change_live():
    from mixplane.mixing import spec_with_mixture
    from mixplane.spec import effective_base_weights

    s = spec(sources=4, mixture={"rows": {"d": 2}})
    assert effective_base_weights(s) == {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0}
    with pytest.raises(SpecError, match="mixture.rows: cannot change in a running mixture"):
        spec_with_mixture(s, {"rows": {"d": 3}})


def test_the_pass_of_a_split_documents_later_piece_is_its_rows():
    from mixplane.loader.split import piece_key
    from mixplane.samples import sample_pass

    keys = [int(make_key(e, r)) for e in (0, 1, 3) for r in (0, 5, (1 << 40) - 1)]
    pieces = [piece_key(k, p) for k in keys for p in (0, 1, 4095)]
    assert sample_pass(np.array(pieces)).tolist() == [int(key_epoch(k)) for k in keys for _ in range(3)]
    assert any(k < 0 for k in pieces)


def test_a_capped_source_is_not_re_partitioned_and_a_rows_source_takes_no_live_share():
    from mixplane.repartition import RepartitionError

    planner = StepPlanner(spec(a={"max_epochs": 2}))
    plan_steps(planner, 2)
    with pytest.raises(RepartitionError, match="source 'a': a source with a limit on its passes"):
        planner.repartition(0, 2)
    planner.repartition(1, 2)  # an uncapped one still is

    planner = StepPlanner(spec(sources=4, mixture={"weights": {"a": 0.5, "b": 0.5}, "rows": {"d": 2}}))
    with pytest.raises(ValueError, match="weights.d: source 'd' is weighted by rows"):
        planner.apply_update({"weights": {"d": 0.3}})
    event, _ = planner.apply_update({"weights": {"a": 0.2, "d": 0}})
    assert event["generation"] == 1


def test_a_strategys_own_schedule_does_not_bring_an_ended_source_back():
    from mixplane.mixing import MixtureSchedule
    from mixplane.planner.dgraph import vanilla_strategy

    s = spec(a={"max_epochs": 1})

    def strategy(ctx):
        ctx.mix(MixtureSchedule(ctx.spec))  # knows nothing of ends
        return vanilla_strategy(ctx)

    own, plain = StepPlanner(s, strategy), StepPlanner(s)
    a, b = plan_steps(own, 16), plan_steps(plain, 16)
    end = next(pl.layout.step for pl in b if pl.ended)
    assert [pl.ended for pl in a] == [pl.ended for pl in b]
    assert [layout_digest(x.layout) for x in a] == [layout_digest(y.layout) for y in b]
    assert not any((pl.pieces.source == 0).any() for pl in a[end + 1:])


def test_mixplane_validate_names_each_field(tmp_path, capsys):
    import yaml

    from mixplane.cli import main

    doc = {"sources": [{"name": "a", "uri": "/x/a", "kind": "tokens", "columns": ["t", "repo"], "live": True,
                        "max_epochs": 2, "pack_by": "repo"},
                       {"name": "b", "uri": "/x/b", "kind": "tokens", "columns": ["t"]}],
           "mixture": {"weights": {"a": 1, "b": 1}, "rows": {"b": 2}}, "batch": {"sequences": 8, "seq_len": 256}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    rc = main(["validate", "--no-files", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 2
    fields = {line.split(": ")[1] for line in lines}
    assert {"sources[0].max_epochs", "sources[0].shuffle", "sources[0].live", "mixture.weights.b"} <= fields, lines
    assert all(line.startswith(f"{path}: ") for line in lines)
