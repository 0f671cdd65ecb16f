"""The Hugging Face Trainer fed by mixplane (issue 23), with the real transformers / accelerate, on the CPU.

A tiny Llama is trained by `MixplaneTrainer` under torchrun (2 ranks, DDP over gloo) for 8 optimizer steps of
one mixture step each (gradient accumulation = the mixture's 2 microbatches). A second job is SIGKILLed after
step 6 and resumed from the Trainer's own checkpoint of step 4: the batches it trains on from step 4 equal the
uninterrupted run's, rank for rank, and so do its losses; nothing before step 4 is read again (no
skip_first_batches replay). The same checkpoint resumed at DP = 1 (a new data plane) continues the same global
sequence. Every optimizer step ran at the scheduler's learning rate times the mixture's lr_scale of its step.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import transformers  # noqa: E402,F401 - installed by make test (extra hf): a missing install fails
import accelerate  # noqa: E402,F401

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


def run(rt: EmbeddedRuntime, out, nproc: int, *, die_at: int = -1, resume: bool = False) -> int:
    out.mkdir(exist_ok=True)
    return torchrun("hf_train.py", nproc, [str(out), str(STEPS), str(SAVE_AT), str(die_at), str(int(resume)), str(ACCUM)],
                    {**rt.client_env(), "MIXPLANE_POD_DIR": str(pod_dir(out))}, out / "log.txt")


@pytest.fixture(scope="module")
def reference(token_sources, tmp_path_factory):
    base = tmp_path_factory.mktemp("hf-ref")
    with EmbeddedRuntime(spec(token_sources["root"], 2), base / "run") as rt:
        assert run(rt, base / "out", 2) == 0, (base / "out" / "log.txt").read_text()[-4000:]
        (base / "out" / "status.json").write_text(json.dumps(rt.status()))
    # the framework's end of training closed each rank's loader cleanly: sidecar loaders would end with the pod
    assert pod_states(base / "out", 2) == ["done", "done"]
    return base / "out"


def test_hf_trainer_killed_and_resumed_trains_on_the_same_batches(token_sources, tmp_path, reference):
    ref = records(reference, 2)
    ref_rows = rows_by_step(ref)
    assert sorted(ref_rows) == list(range(STEPS))
    first = next(x for x in ref[0] if "ids" in x)
    assert {"input_ids", "labels", "shift_labels", "position_ids", "cu_seq_lens_q", "max_length_q"} <= set(first["keys"])
    # the two ranks trained on different data, and their checkpoints hold one global position
    assert not np.array_equal(ref_rows[0][: len(ref_rows[0]) // 2], ref_rows[0][len(ref_rows[0]) // 2 :])
    ckpt = reference / f"checkpoint-{SAVE_AT}"
    states = [json.loads((ckpt / f"mixplane_rank{r}.json").read_text()) for r in range(2)]
    assert states[0] == states[1] and states[0]["loader"]["next_step"] == SAVE_AT and states[0]["microbatch"] == 0

    out = tmp_path / "out"
    with EmbeddedRuntime(spec(token_sources["root"], 2), tmp_path / "run") as rt:
        assert run(rt, out, 2, die_at=DIE_AT) != 0  # the job was killed
        assert "done" not in pod_states(out, 2)  # a killed rank is never taken for a finished one
        killed = records(out, 2)
        assert max(x["step"] for x in killed[0] if "ids" in x) >= DIE_AT - 1
        for r in range(2):
            (out / f"rec-rank{r}.jsonl").rename(out / f"killed-rank{r}.jsonl")
        assert run(rt, out, 2, resume=True) == 0, (out / "log.txt").read_text()[-4000:]
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


def test_hf_checkpoint_resumes_at_another_dp_size(token_sources, tmp_path, reference):
    ref_rows = rows_by_step(records(reference, 2))
    out = tmp_path / "out"
    out.mkdir()
    src = reference / f"checkpoint-{SAVE_AT}"
    import shutil

    shutil.copytree(src, out / src.name)
    with EmbeddedRuntime(spec(token_sources["root"], 1), tmp_path / "run") as rt:
        assert run(rt, out, 1, resume=True) == 0, (out / "log.txt").read_text()[-4000:]
    got = rows_by_step(records(out, 1))
    assert sorted(got) == list(range(SAVE_AT, STEPS))
    for s in got:
        assert np.array_equal(got[s], ref_rows[s]), f"step {s}: the DP=1 job trained on another global batch"


def test_hf_optimizer_steps_use_the_mixture_lr_scale(token_sources, reference):
    sp = spec(token_sources["root"], 2)
    for r, rs in records(reference, 2).items():
        lrs = [x for x in rs if "lr" in x]
        assert [x["lr_step"] for x in lrs] == list(range(STEPS))
        for x in lrs:
            want = x["sched"] * lr_scale_at(sp, x["lr_step"])
            assert x["lr"] == pytest.approx(want, rel=1e-12), f"rank {r} step {x['lr_step']}"
        assert {lr_scale_at(sp, s) for s in range(STEPS)} == {1.0, 0.5, 0.25}


def test_hf_per_source_losses_reach_the_planner(reference):
    """The ranks' per-source token losses went to the planner (bounded rate: far fewer reports than microbatches)
    and it counted exactly the tokens trained on with a label, per source, through the last step."""
    got = json.loads((reference / "status.json").read_text())["source_loss"]
    trained = sum(x["n"] for rs in records(reference, 2).values() for x in rs if "ids" in x)
    assert got["through"] == STEPS - 1 and 2 <= got["reports"] <= 2 * STEPS
    assert sum(got["tokens"]) == trained and all(t > 0 for t in got["tokens"])
    assert all(m is not None and 0 < m < 20 for m in got["mean"])


def test_accelerate_loop_passes_the_loader_through_and_checkpoints_it(token_sources, tmp_path):
    """accelerate without the Trainer: prepare() hands the per-rank loader back unchanged (no dispatcher, no
    IterableDatasetShard), register_for_checkpointing puts its state into save_state, and load_state in a new
    process-like setup (new Accelerator, new loader) continues with the same microbatches."""
    import torch
    from accelerate import Accelerator

    from mixplane.client import MixtureLoader
    from mixplane.integrations.hf import apply_lr_scale, hf_loader

    def setup(rt):
        acc = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
        model = torch.nn.Embedding(1024, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = hf_loader(MixtureLoader(rt.planner_endpoint, rank=0, max_steps=6, timeout_s=90), accumulation=ACCUM)
        model, opt, prepared = acc.prepare(model, opt, loader)
        assert prepared is loader
        acc.register_for_checkpointing(loader)
        return acc, model, opt, loader

    def train(acc, model, opt, loader, steps):
        seen = []
        for _ in range(steps * ACCUM):
            batch = next(loader)
            with acc.accumulate(model):
                loss = model(batch["input_ids"]).float().pow(2).mean()
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            seen.append((loader.step, batch["input_ids"].reshape(-1).tolist()))
        return seen

    with EmbeddedRuntime(spec(token_sources["root"], 1), tmp_path / "run") as rt:
        acc, model, opt, loader = setup(rt)
        scale = apply_lr_scale(opt, loader)
        train(acc, model, opt, loader, 2)
        acc.save_state(str(tmp_path / "ckpt"))
        after = train(acc, model, opt, loader, 2)
        loader.close()
        assert [s for s, _ in after] == [2, 2, 3, 3]
        sp = spec(token_sources["root"], 1)
        assert [s for _, s in scale.applied] == [lr_scale_at(sp, st) for st in range(4)]  # one optimizer step per step

        acc2, model2, opt2, loader2 = setup(rt)
        acc2.load_state(str(tmp_path / "ckpt"))
        again = train(acc2, model2, opt2, loader2, 2)
        loader2.close()
    assert again == after
