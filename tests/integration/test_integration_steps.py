"""What the framework adapters share (mixplane.integrations.steps), against a real data plane: the microbatch
stream's state in the middle of a step resumes exactly, a framework that fetched ahead saves the state of what it
trained on, a gradient accumulation other than the mixture's microbatches is refused naming the setting, and
LRScale runs each optimizer step at the scaled learning rate and gives the scheduler its own back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mixplane.client import MixtureLoader
from mixplane.integrations.steps import INDEX_KEY, LRScale, MicrobatchStream
from mixplane.runtime import EmbeddedRuntime
from tests.integration.frameworks.common import spec


def ids(mb) -> np.ndarray:
    return mb["input_ids"].numpy().copy()


def test_stream_state_mid_step_and_after_fetch_ahead_resume_exactly(token_sources, tmp_path):
    with EmbeddedRuntime(spec(token_sources["root"], 1), tmp_path / "run") as rt:
        ref = [ids(mb) for mb in MicrobatchStream(MixtureLoader(rt.planner_endpoint, rank=0, max_steps=5))]
        assert len(ref) == 10  # 5 steps x 2 microbatches

        s = MicrobatchStream(MixtureLoader(rt.planner_endpoint, rank=0, max_steps=5), tag=True)
        got = [next(s) for _ in range(5)]  # steps 0, 1 and the first microbatch of step 2
        assert all(np.array_equal(ids(a), b) for a, b in zip(got, ref))
        mid = s.state_dict()
        assert mid["microbatch"] == 1 and mid["loader"]["next_step"] == 2
        s.mark_consumed(got[3][INDEX_KEY])  # the framework trained on step 1's last microbatch, fetched one more
        behind = s.state_dict()
        assert behind["microbatch"] == 0 and behind["loader"]["next_step"] == 2 and s.train_step() == 1
        s.close()

        for state, start in ((mid, 5), (behind, 4)):
            r = MicrobatchStream(MixtureLoader(rt.planner_endpoint, rank=0, max_steps=5))
            r.load_state_dict(state)
            rest = [ids(mb) for mb in r]
            r.close()
            assert len(rest) == len(ref) - start
            assert all(np.array_equal(a, b) for a, b in zip(rest, ref[start:])), f"resume at microbatch {start}"


def test_stream_refuses_an_accumulation_other_than_the_mixtures_microbatches(token_sources, tmp_path):
    with EmbeddedRuntime(spec(token_sources["root"], 1), tmp_path / "run") as rt:
        s = MicrobatchStream(MixtureLoader(rt.planner_endpoint, rank=0, max_steps=2), accumulation=4,
                             what="TrainingArguments.gradient_accumulation_steps")
        with pytest.raises(ValueError, match="gradient_accumulation_steps is 4 but the mixture's batch.microbatches is 2"):
            next(s)
        s.close()


def test_lr_scale_scales_the_step_and_restores_the_schedulers_rate():
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # chained: multiplies the group's lr
    scales = iter([1.0, 0.5, 0.25])
    current = {"s": 1.0}
    hook = LRScale(opt, lambda: current["s"], lambda: None)
    moved = []
    for _ in range(3):
        current["s"] = next(scales)
        before = float(w.detach())
        w.grad = torch.ones(1)
        opt.step()
        moved.append(before - float(w.detach()))
        sched.step()
    assert moved == pytest.approx([0.1 * 1.0, 0.05 * 0.5, 0.025 * 0.25])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0125)  # the scheduler's own rate: the scale did not compound
    assert [s for _, s in hook.applied] == [1.0, 0.5, 0.25]
    hook.remove()
    w.grad = torch.ones(1)
    before = float(w.detach())
    opt.step()
    assert before - float(w.detach()) == pytest.approx(0.0125)
