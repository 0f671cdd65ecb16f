"""Adaptive mixtures against the real planner (issue 23 item 5, first form): two trainer ranks report per-source
losses that are known per source (a: 2, b: 3, c: 5 per token); an AdaptiveController turns each 4-step interval's
losses into DoReMi weights and sends them as whole-mixture live updates. The losses it saw are the reported ones,
its weights follow the method's closed form (c, furthest above its reference, gains), every update is a new
generation the planner acknowledged and delivered from its effective step on, and `mixplane replay` rebuilds a
delivered batch after the last update bit for bit from the journal."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mixplane.adaptive import AdaptiveConfig
from mixplane.adaptivectl import AdaptiveController, AdaptiveUpdate
from mixplane.planner.journal import read_journal
from mixplane.client import MixtureLoader, source_loss
from mixplane.replay import replay_step
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.conftest import token_mixture

STEPS, EVERY = 28, 4
LOSS = {"a": 2.0, "b": 3.0, "c": 5.0}
REF = {"a": 2.0, "b": 2.9, "c": 3.0}


def test_adaptive_controller_moves_the_weights_by_the_reported_losses(token_sources, tmp_path):
    sp = parse_spec(token_mixture(token_sources["root"], runtime={"window": 64, "metrics": False, "journal_every": 5,
                                                                 "max_lead_steps": 2, "prefetch_steps": 1}))
    names = sp.source_names()
    got: dict[int, dict[int, dict]] = {0: {}, 1: {}}
    errors: list[BaseException] = []
    cfg = AdaptiveConfig(every_steps=EVERY, reference_loss=REF, step_size=0.5, smoothing=0.0, max_change=0.2)
    run_dir = tmp_path / "run"
    with EmbeddedRuntime(sp, run_dir) as rt:
        ctl = AdaptiveController(rt.planner_endpoint, sp, cfg, curve=rt.control_curve)

        train_reporting(rt.planner_endpoint, got, errors, timeout_s=90, deadline_s=180, tick=ctl.poll)
        assert not errors, errors[0]
        status = rt.status()

    ups = ctl.updates
    assert len(ups) >= 3, f"{len(ups)} updates"
    # the losses the controller used are the reported ones; the weights follow DoReMi's closed form
    w = np.array([sp.mixture.weights[n] for n in names], float)
    w /= w.sum()
    for u in ups:
        # a source with no token in the interval (its share shrank) has no loss: no excess
        assert [x for x in u.losses if x is not None] == pytest.approx([LOSS[n] for n, x in zip(names, u.losses) if x is not None],
                                                                        rel=1e-9)
        assert u.losses[names.index("c")] is not None
        excess = np.array([LOSS[n] - REF[n] if x is not None else 0.0 for n, x in zip(names, u.losses)])
        target = w * np.exp(0.5 * np.maximum(excess, 0))
        target /= target.sum()
        step = min(1.0, 0.2 / np.abs(target - w).max())
        w = w + step * (target - w)
        assert u.weights == pytest.approx(w.tolist(), rel=1e-12)
    assert ups[-1].weights[names.index("c")] > 0.5 > sp.mixture.weights["c"]
    # each update a new generation, acknowledged, delivered from its effective step on
    assert [u.generation for u in ups] == sorted({u.generation for u in ups})
    assert [x["update_id"] for x in status["updates"]][-len(ups):] == [f"adaptive-{u.interval}" for u in ups]
    for r in range(2):
        for s, b in got[r].items():
            applied = [u.generation for u in ups if u.effective_step <= s]
            assert b["gen"] == (applied[-1] if applied else 0), f"rank {r} step {s}"
    delivered = [u for u in ups if u.effective_step < STEPS]
    assert len(delivered) >= 2  # (a later one takes effect after the run's last step)
    out = replay_step(sp, step=STEPS - 1, rank=0, run_dir=str(run_dir), save=str(tmp_path / "r.npz"))
    assert out["digest_match"]
    assert np.array_equal(np.load(tmp_path / "r.npz")["input_ids"], got[0][STEPS - 1]["ids"])


def train_reporting(endpoint: str, got: dict[int, dict[int, dict]], errors: list[BaseException], *,
                    timeout_s: float, deadline_s: float, tick) -> None:
    """Two trainer ranks (threads) that take STEPS steps, report each token's loss as its source's (LOSS) and keep
    what they received in got[rank][step]; `tick` runs every 50 ms on this thread until they end or deadline_s."""
    def trainer(r: int) -> None:
        try:
            loader = MixtureLoader(endpoint, rank=r, max_steps=STEPS, timeout_s=timeout_s, prefetch=1)
            loader.loss_report_s = 0.0
            per_source = None
            for b in loader:
                if per_source is None:
                    per_source = torch_tensor([LOSS[n] for n in loader.sources])
                tok = per_source[b["source_ids"].clamp(min=0).long()]  # each token's loss: its source's
                loader.report_loss(int(b["step"]), *source_loss(tok, b["source_ids"], len(loader.sources), b["labels"]))
                got[r][int(b["step"])] = {"ids": b["input_ids"].numpy().copy(), "gen": int(b["generation"]),
                                          "seg": b["segment_key"].numpy().copy()}
                time.sleep(0.1)  # a trainer's step: the controller keeps up
            loader.close()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + deadline_s
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        tick()
        time.sleep(0.05)
    for t in threads:
        t.join(10)


def torch_tensor(values):
    import torch

    return torch.tensor(values, dtype=torch.float64)



def journaled_updates(run_dir) -> list[AdaptiveUpdate]:
    """The adaptive updates a planner made itself (mixture.adaptive), from its journal (once each: a recovered planner
    journals the updates it applies again)."""
    seen: dict[int, AdaptiveUpdate] = {}
    for r in read_journal(str(run_dir / "journal.jsonl")):
        a = r.get("adaptive") if r.get("event") == "update" else None
        if a is not None and a["k"] not in seen:
            seen[a["k"]] = AdaptiveUpdate(a["k"], a["losses"], a["weights"], int(r["generation"]),
                                          int(r["effective_step"]), a["late"])
    return [seen[k] for k in sorted(seen)]


def adaptive_run(sp, run_dir, *, kill_at: int | None, cfg: AdaptiveConfig | None, delay: int):
    """Two trainer ranks reporting constant per-source losses, an AdaptiveController with fixed effective steps (cfg;
    None: the spec's mixture.adaptive, the planner adapts by itself), and (kill_at) a SIGKILL of the planner once the
    trainers passed that step (supervision restarts it)."""
    import os
    import signal

    from mixplane.runtime import RestartPolicy

    got: dict[int, dict[int, dict]] = {0: {}, 1: {}}
    errors: list[BaseException] = []
    rt = EmbeddedRuntime(sp, run_dir, restart=RestartPolicy(budget=2, window_s=600, backoff_s=0.1)).start()
    killed = None
    try:
        rt.supervise_in_background(0.1)
        ctl = None if cfg is None else AdaptiveController(rt.planner_endpoint, sp, cfg, curve=rt.control_curve,
                                                          timeout_s=2.0, delay_steps=delay)

        def tick() -> None:
            nonlocal killed
            if ctl is not None:
                ctl.poll()
            if kill_at is not None and killed is None and min(len(got[0]), len(got[1])) > kill_at:
                killed = rt.child("planner").proc.pid
                os.kill(killed, signal.SIGKILL)

        train_reporting(rt.planner_endpoint, got, errors, timeout_s=120, deadline_s=240, tick=tick)
        assert not errors, errors[0]
        if kill_at is not None:
            assert killed is not None and rt.child("planner").proc.pid != killed
        return got, (ctl.updates if ctl is not None else journaled_updates(run_dir))
    finally:
        rt.stop()


def test_an_adaptive_run_with_a_planner_sigkill_gives_the_same_generations_and_batches(token_sources, tmp_path):
    sp = parse_spec(token_mixture(token_sources["root"], runtime={"window": 64, "metrics": False, "journal_every": 5,
                                                                 "max_lead_steps": 2, "prefetch_steps": 1}))
    # min_weight keeps every source in every step: each interval's per-source mean is its constant loss, whichever
    # reports a killed planner lost
    cfg = AdaptiveConfig(every_steps=EVERY, reference_loss=REF, step_size=0.5, smoothing=0.0, min_weight=0.15,
                         max_change=0.1)
    ref, ref_ups = adaptive_run(sp, tmp_path / "ref", kill_at=None, cfg=cfg, delay=8)
    got, ups = adaptive_run(sp, tmp_path / "kill", kill_at=10, cfg=cfg, delay=8)
    key = [(u.interval, u.generation, u.effective_step, u.weights, u.late) for u in ref_ups]
    assert [(u.interval, u.generation, u.effective_step, u.weights, u.late) for u in ups][: len(key)] == key[: len(ups)]
    assert len([u for u in ref_ups if u.effective_step < STEPS]) >= 3 and not any(u.late for u in ref_ups + ups)
    for r in range(2):
        assert sorted(got[r]) == sorted(ref[r]) == list(range(STEPS))
        for s in range(STEPS):
            assert got[r][s]["gen"] == ref[r][s]["gen"], f"rank {r} step {s}: generation"
            assert np.array_equal(got[r][s]["ids"], ref[r][s]["ids"]), f"rank {r} step {s}: other tokens"


def test_mixture_adaptive_in_the_spec_the_planner_adapts_as_the_controller_would_also_through_a_sigkill(token_sources,
                                                                                                       tmp_path):
    """`mixture.adaptive` in the spec: the planner turns the reports into the same updates (intervals, generations,
    effective steps, weights bit for bit) and so the same batches as an AdaptiveController with that configuration,
    and a planner SIGKILLed mid-run (its adaptive state from the journal) changes none of it."""
    section = {"every_steps": EVERY, "delay_steps": 8, "reference_loss": REF, "step_size": 0.5, "smoothing": 0.0,
               "min_weight": 0.15, "max_change": 0.1}
    doc = token_mixture(token_sources["root"], runtime={"window": 64, "metrics": False, "journal_every": 5,
                                                        "max_lead_steps": 2, "prefetch_steps": 1})
    sp = parse_spec(doc)
    adaptive = parse_spec({**doc, "mixture": {**doc["mixture"], "adaptive": section}})
    cfg = AdaptiveConfig.of({k: v for k, v in section.items() if k != "delay_steps"})
    ref, ref_ups = adaptive_run(sp, tmp_path / "controller", kill_at=None, cfg=cfg, delay=8)
    alone, ups = adaptive_run(adaptive, tmp_path / "planner", kill_at=None, cfg=None, delay=8)
    killed, kill_ups = adaptive_run(adaptive, tmp_path / "planner-kill", kill_at=10, cfg=None, delay=8)
    key = [(u.interval, u.generation, u.effective_step, list(u.weights), u.late) for u in ref_ups]
    assert len([u for u in ref_ups if u.effective_step < STEPS]) >= 3
    for got_ups in (ups, kill_ups):
        mine = [(u.interval, u.generation, u.effective_step, list(u.weights), u.late) for u in got_ups]
        n = min(len(mine), len(key))
        assert n >= 3 and mine[:n] == key[:n]
    for got in (alone, killed):
        for r in range(2):
            assert sorted(got[r]) == list(range(STEPS))
            for s in range(STEPS):
                assert got[r][s]["gen"] == ref[r][s]["gen"], f"rank {r} step {s}: generation"
                assert np.array_equal(got[r][s]["ids"], ref[r][s]["ids"]), f"rank {r} step {s}: other tokens"
