"""Lightning fed by mixplane's MixtureDataModule (issue 23), with the real Lightning, on the CPU.

A tiny GPT is trained by `lightning.pytorch.Trainer` under torchrun (2 ranks, DDP over gloo) for 8 optimizer steps
of one mixture step each (accumulate_grad_batches = the mixture's 2 microbatches). A second job is SIGKILLed after
step 6 and resumed from Lightning's own checkpoint of step 4 (the loader's state_dict inside it, saved by the fit
loop): the batches it trains on from step 4 equal the uninterrupted run's, rank for rank, and so do its losses —
although Lightning fetched a batch ahead when it saved. The same checkpoint resumed at DP = 1 (a new data plane)
continues the same global sequence. Every optimizer step ran at the scheduler's learning rate times the mixture's
lr_scale of its step.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import lightning  # noqa: E402,F401 - installed by make test (extra lightning): a missing install fails
import torch  # noqa: E402

from mixplane import podend  # noqa: E402
from mixplane.runtime import EmbeddedRuntime  # noqa: E402
from tests.integration.frameworks.common import DIE_AT, SAVE_AT, STEPS, lr_scale_at, records, rows_by_step, spec, torchrun  # noqa: E402

ACCUM = 2  # token_mixture's batch.microbatches


def pod_dir(out):
    """The directory a trainer pod shares with its sidecar loaders (mixplane.podend): each rank marks its end there."""
    (out / "pod").mkdir(exist_ok=True)
    return out / "pod"


def pod_states(out, ranks: int) -> list[str]:
    return [podend.rank_state(str(out / "pod"), r).value for r in range(ranks)]


def run(rt: EmbeddedRuntime, out, nproc: int, *, die_at: int = -1, ckpt: str = "-") -> int:
    out.mkdir(exist_ok=True)
    return torchrun("lightning_train.py", nproc, [str(out), str(STEPS), str(SAVE_AT), str(die_at), ckpt, str(ACCUM)],
                    {**rt.client_env(), "MIXPLANE_POD_DIR": str(pod_dir(out))}, out / "log.txt")


@pytest.fixture(scope="module")
def reference(token_sources, tmp_path_factory):
    base = tmp_path_factory.mktemp("pl-ref")
    with EmbeddedRuntime(spec(token_sources["root"], 2), base / "run") as rt:
        assert run(rt, base / "out", 2) == 0, (base / "out" / "log.txt").read_text()[-4000:]
        (base / "out" / "status.json").write_text(json.dumps(rt.status()))
    # the framework's end of training closed each rank's loader cleanly: sidecar loaders would end with the pod
    assert pod_states(base / "out", 2) == ["done", "done"]
    return base / "out"


def test_lightning_killed_and_resumed_trains_on_the_same_batches(token_sources, tmp_path, reference):
    ref = records(reference, 2)
    assert sorted(rows_by_step(ref)) == list(range(STEPS))
    first = next(x for x in ref[0] if "ids" in x)
    assert {"input_ids", "labels", "position_ids", "source_ids", "cu_seqlens", "step", "lr_scale"} <= set(first["keys"])
    assert "mixplane_index" not in first["keys"]
    ckpt = reference / "ckpt" / f"step={SAVE_AT}.ckpt"
    saved = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert len(saved) == 1 and saved[0]["loader"]["next_step"] == SAVE_AT and saved[0]["microbatch"] == 0

    out = tmp_path / "out"
    with EmbeddedRuntime(spec(token_sources["root"], 2), tmp_path / "run") as rt:
        assert run(rt, out, 2, die_at=DIE_AT) != 0  # the job was killed
        assert "done" not in pod_states(out, 2)  # a killed rank is never taken for a finished one
        assert max(x["step"] for x in records(out, 2)[0] if "ids" in x) >= DIE_AT - 1
        for r in range(2):
            (out / f"rec-rank{r}.jsonl").rename(out / f"killed-rank{r}.jsonl")
        assert run(rt, out, 2, ckpt=str(out / "ckpt" / f"step={SAVE_AT}.ckpt")) == 0, (out / "log.txt").read_text()[-4000:]
        assert pod_states(out, 2) == ["done", "done"]  # the resumed ranks took their marks again and finished
    resumed = records(out, 2)
    for r in range(2):
        steps = [x["step"] for x in resumed[r] if "ids" in x]
        assert steps == [s for s in range(SAVE_AT, STEPS) for _ in range(ACCUM)], f"rank {r} trained on steps {steps}"
        got = {(x["step"], x["mb"]): x for x in resumed[r] if "ids" in x}
        want = {(x["step"], x["mb"]): x for x in ref[r] if "ids" in x and x["step"] >= SAVE_AT}
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k]["ids"] == want[k]["ids"], f"rank {r} step {k}: other tokens than the uninterrupted run"
            assert got[k]["loss"] == pytest.approx(want[k]["loss"], rel=1e-5), f"rank {r} step {k}: loss differs"


def test_lightning_checkpoint_resumes_at_another_dp_size(token_sources, tmp_path, reference):
    ref_rows = rows_by_step(records(reference, 2))
    out = tmp_path / "out"
    (out / "ckpt").mkdir(parents=True)
    shutil.copy(reference / "ckpt" / f"step={SAVE_AT}.ckpt", out / "ckpt" / "from-dp2.ckpt")
    with EmbeddedRuntime(spec(token_sources["root"], 1), tmp_path / "run") as rt:
        assert run(rt, out, 1, ckpt=str(out / "ckpt" / "from-dp2.ckpt")) == 0, (out / "log.txt").read_text()[-4000:]
    got = rows_by_step(records(out, 1))
    assert sorted(got) == list(range(SAVE_AT, STEPS))
    for s in got:
        assert np.array_equal(got[s], ref_rows[s]), f"step {s}: the DP=1 job trained on another global batch"


def test_lightning_optimizer_steps_use_the_mixture_lr_scale(token_sources, reference):
    sp = spec(token_sources["root"], 2)
    for r, rs in records(reference, 2).items():
        lrs = [x for x in rs if "lr" in x]
        assert [x["lr_step"] for x in lrs] == list(range(STEPS))
        for x in lrs:
            assert x["lr"] == pytest.approx(x["sched"] * lr_scale_at(sp, x["lr_step"]), rel=1e-12), f"rank {r} step {x['lr_step']}"


def test_lightning_per_source_losses_reach_the_planner(reference):
    """The ranks' per-source token losses went to the planner (bounded rate: far fewer reports than microbatches)
    and it counted exactly the tokens trained on with a label, per source, through the last step."""
    got = json.loads((reference / "status.json").read_text())["source_loss"]
    trained = sum(x["n"] for rs in records(reference, 2).values() for x in rs if "ids" in x)
    assert got["through"] == STEPS - 1 and 2 <= got["reports"] <= 2 * STEPS
    assert sum(got["tokens"]) == trained and all(t > 0 for t in got["tokens"])
    assert all(m is not None and 0 < m < 20 for m in got["mean"])
