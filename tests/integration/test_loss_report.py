"""Per-source loss back to the planner (issue 23 item 4), through the real planner process: two ranks report
per-source loss sums computed from their batches' source_ids; the planner's STATUS holds exactly what was sent
(totals, each rank's newest report), its journal records every report as received, reports go at the bounded
rate (one per interval whatever the step rate, the rest at close), and a malformed report is dropped without
an answer while delivery goes on."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import zmq

from mixplane import wire
from mixplane.client import MixtureLoader, source_loss
from mixplane.runtime import EmbeddedRuntime
from mixplane.wire import Kind
from tests.integration.frameworks.common import spec

STEPS = 6


def journal_losses(rt: EmbeddedRuntime) -> list[dict]:
    recs = []
    for p in rt.run_dir.rglob("journal.jsonl"):
        recs += [r for r in (json.loads(x) for x in p.read_text().splitlines() if x.strip()) if r.get("event") == "loss"]
    return recs


def test_ranks_report_per_source_loss_and_the_planner_keeps_and_journals_it(token_sources, tmp_path):
    sent: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {0: [], 1: []}
    errors: list[BaseException] = []
    with EmbeddedRuntime(spec(token_sources["root"], 2), tmp_path / "run") as rt:
        def work(r: int, interval: float) -> None:
            try:
                loader = MixtureLoader(rt.planner_endpoint, rank=r, max_steps=STEPS, timeout_s=90)
                loader.loss_report_s = interval
                for b in loader:
                    # a stand-in for the model's per-token loss: a known function of the token and its source
                    tok_loss = (b["input_ids"].double() % 7) / 7.0 + b["source_ids"].clamp(min=0).double()
                    s, n = source_loss(tok_loss, b["source_ids"], len(loader.sources), b["labels"])
                    sent[r].append((s.numpy(), n.numpy()))
                    loader.report_loss(int(b["step"]), s, n)
                loader.close()  # sends what is left
                assert loader.loss_reports_sent == (STEPS if interval == 0 else 1)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(r, 0.0 if r == 0 else 3600.0)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[0]

        # a malformed report (one source too few) from a raw client socket: dropped, no answer, planner goes on
        ctx = zmq.Context.instance()
        raw = ctx.socket(zmq.DEALER)
        raw.connect(rt.planner_endpoint)
        wire.send(raw, Kind.LOSS_REPORT, {"rank": 0, "from_step": 0, "step": 0, "loss": [1.0], "tokens": [1]})
        assert not raw.poll(500)
        raw.close(0)
        st = rt.status()

    tot_s = sum(s for r in sent for s, _ in sent[r])
    tot_n = sum(n for r in sent for _, n in sent[r])
    got = st["source_loss"]
    assert got["reports"] == STEPS + 1 and got["through"] == STEPS - 1
    assert got["ranks"] == {"0": STEPS - 1, "1": STEPS - 1}  # each rank's newest step (what adaptation waits on)
    assert got["tokens"] == tot_n.tolist() and all(t > 0 for t in got["tokens"])
    assert got["mean"] == pytest.approx((tot_s / tot_n).tolist(), rel=1e-12)
    # the newest report of rank 0 is its last step; rank 1 sent one report for all its steps
    r1_s, r1_n = sum(s for s, _ in sent[1]), sum(n for _, n in sent[1])
    assert got["recent"] == pytest.approx(((sent[0][-1][0] + r1_s) / (sent[0][-1][1] + r1_n)).tolist(), rel=1e-12)
    assert got["mean"][2] > got["mean"][1] > got["mean"][0]  # the stand-in loss grows with the source index

    recs = journal_losses(rt)
    assert len(recs) == STEPS + 1
    by_rank = {r: [x for x in recs if x["rank"] == r] for r in range(2)}
    assert [(x["from_step"], x["step"]) for x in by_rank[0]] == [(s, s) for s in range(STEPS)]
    assert [(x["from_step"], x["step"]) for x in by_rank[1]] == [(0, STEPS - 1)]
    assert by_rank[1][0]["tokens"] == r1_n.tolist()
    assert by_rank[1][0]["loss"] == pytest.approx(r1_s.tolist(), rel=1e-12)
