"""Megatron-Core fed by mixplane (issue 23), with the real megatron-core, on the CPU.

Megatron-Core does not train on the CPU (its attention allocates CUDA buffers), so its own batch-consuming
functions run on the adapter's batches instead, under torchrun (2 ranks = one context-parallel group of 2, gloo):
`get_batch_on_this_cp_rank` cuts the rows both CP ranks received (gathered) into exactly what mixplane delivered
to each, and a tiny GPTModel's embedding, output layer and `compute_language_model_loss` with `loss_mask` give the
cross entropy over the mixture's labels. The iterator's state saved after step 2 where Megatron-LM's checkpointing
puts it (`iter_0000002/train_dataloader_dprank000.pt`) resumes in a new job: the same microbatches from step 2 on.
The full training check (a GPU) is not run here.
"""

from __future__ import annotations

import pytest

import megatron.core  # noqa: E402,F401 - installed by make test (extra megatron): a missing install fails, it is not skipped

from mixplane.runtime import EmbeddedRuntime  # noqa: E402
from mixplane.spec import parse_spec  # noqa: E402
from tests.conftest import token_mixture  # noqa: E402
from tests.integration.frameworks.common import records, torchrun  # noqa: E402

STEPS, SAVE_AT = 4, 2


def test_megatron_batches_cp_cut_loss_and_resume(token_sources, tmp_path):
    spec = parse_spec(token_mixture(token_sources["root"], topology={"modules": {"backbone": {"dp": 1, "cp": 2}}},
                                    runtime={"window": 64, "metrics": False}))
    out = tmp_path / "out"
    out.mkdir()
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        env = rt.client_env()
        assert torchrun("megatron_check.py", 2, [str(out), "train", str(STEPS), str(SAVE_AT)], env, out / "log.txt") == 0, \
            (out / "log.txt").read_text()[-4000:]
        assert (out / "dataloader" / f"iter_{SAVE_AT:07d}" / "train_dataloader_dprank000.pt").is_file()
        ref = records(out, 2)
        for r in range(2):
            (out / f"rec-rank{r}.jsonl").rename(out / f"train-rank{r}.jsonl")
    with EmbeddedRuntime(spec, tmp_path / "run2") as rt:  # a new job and a new data plane
        assert torchrun("megatron_check.py", 2, [str(out), "resume", str(STEPS), str(SAVE_AT)], rt.client_env(),
                        out / "log.txt") == 0, (out / "log.txt").read_text()[-4000:]
    got = records(out, 2)
    for r in range(2):
        assert [(x["step"], x["mb"]) for x in ref[r]] == [(s, m) for s in range(STEPS) for m in range(2)]
        assert any(x["masked"] > 0 for x in ref[r])  # -100 labels became loss_mask 0 (documents end in every row)
        want = {(x["step"], x["mb"]): x for x in ref[r] if x["step"] >= SAVE_AT}
        resumed = {(x["step"], x["mb"]): x for x in got[r]}
        assert sorted(resumed) == sorted(want)
        for k in want:
            assert resumed[k]["ids"] == want[k]["ids"], f"rank {r} {k}: other tokens after the resume"
            assert resumed[k]["loss"] == pytest.approx(want[k]["loss"], rel=1e-6)
    # the two CP ranks hold different halves of the same rows
    for k in {(x["step"], x["mb"]) for x in ref[0]}:
        a = next(x for x in ref[0] if (x["step"], x["mb"]) == k)
        b = next(x for x in ref[1] if (x["step"], x["mb"]) == k)
        assert a["full"] == b["full"] and a["ids"] != b["ids"]


def test_megatron_cp_broadcast_delivers_megatrons_cut(token_sources, tmp_path):
    """broadcast_at('CP') with megatron_groups(): CP rank 0 alone fetches, the client cuts the other rank's half;
    Megatron's get_batch_on_this_cp_rank of the gathered rows is again what each rank holds, the loss checks hold."""
    spec = parse_spec(token_mixture(token_sources["root"], topology={"modules": {"backbone": {"dp": 1, "cp": 2}}},
                                    strategy={"name": "llm_balance", "options": {"broadcast": ["CP"]}},
                                    runtime={"window": 64, "metrics": False}))
    out = tmp_path / "out"
    out.mkdir()
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        assert torchrun("megatron_check.py", 2, [str(out), "broadcast", "2", "0"], rt.client_env(), out / "log.txt") == 0, \
            (out / "log.txt").read_text()[-4000:]
    got = records(out, 2)
    for r in range(2):
        assert [(x["step"], x["mb"]) for x in got[r]] == [(s, m) for s in range(2) for m in range(2)]
    for a, b in zip(got[0], got[1]):
        assert a["full"] == b["full"] and a["ids"] != b["ids"]
