"""Pure parts of the `mixplane` command: argument -> request mapping and the progress line."""

from __future__ import annotations

import math

import pytest

from mixplane.cli import build_parser, format_progress, update_message


def test_update_maps_arguments_to_the_planner_request():
    args = build_parser().parse_args(["update", "--planner", "tcp://127.0.0.1:1", "--step", "500", "--weight", "web=0.25",
                                      "--weight", "code=0.75", "--lr-scale", "0.5", "--temperature", "2"])
    assert update_message(args.weight, args.step, args.lr_scale, args.temperature) == {
        "weights": {"web": 0.25, "code": 0.75}, "effective_step": 500, "lr_scale": 0.5, "temperature": 2.0}


def test_update_leaves_out_what_was_not_given():
    assert update_message(["a=1"], 3) == {"weights": {"a": 1.0}, "effective_step": 3}
    args = build_parser().parse_args(["update", "--planner", "tcp://x:1", "--step", "0"])
    assert args.temperature is None and args.lr_scale is None


@pytest.mark.parametrize("t", [0.0, -1.0, math.inf, math.nan])
def test_update_rejects_bad_temperature(t):
    with pytest.raises(ValueError, match="--temperature must be a finite number > 0"):
        update_message(["a=1"], 0, temperature=t)


@pytest.mark.parametrize("lr", [0.0, math.inf, math.nan])
def test_update_rejects_bad_lr_scale(lr):
    with pytest.raises(ValueError, match="--lr-scale must be a finite number > 0"):
        update_message(["a=1"], 0, lr_scale=lr)


@pytest.mark.parametrize("kv", ["a", "=1", "a=x", "a=-1", "a=inf", "a=nan"])
def test_update_rejects_bad_weights(kv):
    with pytest.raises(ValueError, match="--weight"):
        update_message([kv], 0)


def test_update_rejects_negative_step():
    with pytest.raises(ValueError, match="--step must be >= 0"):
        update_message(["a=1"], -1)


def test_update_command_exits_2_on_bad_input_without_contacting_the_planner(capsys):
    args = build_parser().parse_args(["update", "--planner", "tcp://127.0.0.1:1", "--step", "1", "--temperature", "0"])
    assert args.fn(args) == 2
    assert "mixplane update: --temperature must be a finite number > 0, got 0.0" in capsys.readouterr().err


def status(**kw) -> dict:
    st = {"planned_through": 42, "phase": 1, "sources": ["web", "code"], "target": [0.7, 0.3],
          "realized_phase": [0.6875, 0.3125]}
    return {**st, **kw}


def test_progress_line_shows_step_phase_rate_and_shares():
    assert format_progress(status(), 12345.0) == \
        "step     42 | phase 1 |     12.3k tok/s | web  68.8% (70.0%) | code  31.2% (30.0%)"


def test_progress_line_names_sources_it_waits_for():
    line = format_progress(status(waiting=["code", "web"]), 0.0)
    assert line.endswith(" | waiting: code,web")
    assert "waiting" not in format_progress(status(waiting=[]), 0.0)


def test_progress_line_names_refused_loaders_first_and_few():
    line = format_progress(status(refused_loaders={"web/1": "why", "web/0": "why"}), 0.0)
    assert line.startswith("step     42 | phase 1 |      0.0k tok/s | refused: web/0,web/1 | web ")
    many = format_progress(status(refused_loaders={f"s{i}/0": "why" for i in range(7)}), 0.0)
    assert "| refused: s0/0,s1/0,s2/0,s3/0 +3 |" in many
    assert "refused" not in format_progress(status(refused_loaders={}), 0.0)
