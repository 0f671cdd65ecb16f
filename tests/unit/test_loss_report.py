"""Per-source loss reports (issue 23 item 4), the pure parts: the LOSS_REPORT check naming the field, the
planner's aggregation, and the client's per-source sums from source_ids."""

from __future__ import annotations

import math

import pytest
import torch

from mixplane import protocol
from mixplane.client import source_loss
from mixplane.planner.losses import SourceLosses
from mixplane.wire import Kind, WireError


def meta(**kw):
    return {"rank": 1, "from_step": 3, "step": 5, "loss": [6.0, 0.0, 1.5], "tokens": [3, 0, 1], **kw}


def test_a_report_parses_and_bad_ones_name_the_field():
    r = protocol.parse_loss_report(meta(), 3)
    assert (r.rank, r.from_step, r.step, r.loss, r.tokens) == (1, 3, 5, (6.0, 0.0, 1.5), (3, 0, 1))
    for bad, what in [(meta(loss=[1.0, 2.0]), r"loss must list one value per source \(3\), got 2"),
                      (meta(tokens="x"), r"tokens must list one value per source \(3\), got str"),
                      (meta(loss=[1.0, math.nan, 0.0]), r"loss\[1\] must be a finite number >= 0"),
                      (meta(loss=[-1.0, 0.0, 0.0]), r"loss\[0\] must be a finite number >= 0"),
                      (meta(tokens=[1, True, 1]), r"tokens\[1\] must be an integer >= 0"),
                      (meta(tokens=[1, 0, 1], loss=[1.0, 2.0, 1.0]), r"loss\[1\] is 2.0 over 0 tokens"),
                      (meta(step=2), "from_step 3 is after step 2"),
                      (meta(rank=-1), "rank must be an integer >= 0")]:
        with pytest.raises(WireError, match=what):
            protocol.parse_loss_report(bad, 3)


def test_loss_reports_are_a_rank_bound_control_kind_with_a_schema():
    assert Kind.LOSS_REPORT in protocol.CONTROL_KINDS and Kind.LOSS_REPORT in protocol.RANK_KINDS
    assert not protocol.allowed(Kind.LOSS_REPORT, protocol.ANONYMOUS)
    assert protocol.allowed(Kind.LOSS_REPORT, protocol.CLIENT)
    assert set(protocol.SCHEMAS[Kind.LOSS_REPORT].fields) == {"rank", "from_step", "step", "loss", "tokens"}


def test_the_planner_keeps_totals_and_each_ranks_newest_report():
    agg = SourceLosses(2)
    agg.add(protocol.parse_loss_report({"rank": 0, "from_step": 0, "step": 1, "loss": [4.0, 0.0], "tokens": [2, 0]}, 2))
    agg.add(protocol.parse_loss_report({"rank": 1, "from_step": 0, "step": 1, "loss": [3.0, 6.0], "tokens": [1, 3]}, 2))
    agg.add(protocol.parse_loss_report({"rank": 0, "from_step": 2, "step": 3, "loss": [1.0, 1.0], "tokens": [1, 1]}, 2))
    st = agg.status()
    assert st["reports"] == 3 and st["through"] == 3 and st["tokens"] == [4, 4]
    assert st["mean"] == [pytest.approx(8.0 / 4), pytest.approx(7.0 / 4)]
    assert st["recent"] == [pytest.approx((1.0 + 3.0) / 2), pytest.approx((1.0 + 6.0) / 4)]
    assert SourceLosses(2).mean() == [None, None]


def test_source_loss_sums_by_source_ids_and_skips_padding_and_ignored_labels():
    tok = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    src = torch.tensor([[0, 0, 2, -1], [2, 2, 0, -1]], dtype=torch.int32)
    labels = torch.tensor([[9, -100, 9, -100], [9, 9, 9, -100]])
    s, n = source_loss(tok, src, 3, labels)
    assert s.tolist() == [1.0 + 7.0, 0.0, 3.0 + 5.0 + 6.0] and n.tolist() == [2, 0, 3]
    s, n = source_loss(tok, src, 3)
    assert n.tolist() == [3, 0, 3]
