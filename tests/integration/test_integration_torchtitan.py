"""torchtitan fed by mixplane (issue 23), with the real torchtitan dataloader base class and torch's DCP, on the CPU.

`MixplaneDataLoader` is built as torchtitan's trainer builds its dataloader (`Config.build(dp_rank=, dp_world_size=,
...)`) under torchrun (2 ranks, gloo) and iterated for 4 steps of 2 microbatches: `({"input", "positions"}, labels)`
with positions restarting at every document and IGNORE_INDEX labels at document ends. Its state saved through DCP
after step 2 resumes a new job with the same microbatches from step 2 on, and a job at DP = 1 (new data plane)
continues the same global sequence — where torchtitan's own ParallelAwareDataloader refuses another DP size. The
models' training (torchtitan's model code needs triton) is not run here.
"""

from __future__ import annotations

import numpy as np
import pytest

import torchtitan  # noqa: E402,F401 - installed by make test: a missing install fails, it is not skipped

from mixplane.runtime import EmbeddedRuntime  # noqa: E402
from mixplane.spec import parse_spec  # noqa: E402
from tests.conftest import token_mixture  # noqa: E402
from tests.integration.frameworks.common import records, rows_by_step, torchrun  # noqa: E402

STEPS, SAVE_AT = 4, 2


def spec(root, dp):
    return parse_spec(token_mixture(root, topology={"modules": {"backbone": {"dp": dp}}}, runtime={"window": 64, "metrics": False}))


def test_torchtitan_loader_resumes_through_dcp_also_at_another_dp(token_sources, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with EmbeddedRuntime(spec(token_sources["root"], 2), tmp_path / "run") as rt:
        assert torchrun("titan_check.py", 2, [str(out), "train", str(STEPS), str(SAVE_AT)], rt.client_env(), out / "log.txt") == 0, \
            (out / "log.txt").read_text()[-4000:]
    ref = records(out, 2)
    for r in range(2):
        (out / f"rec-rank{r}.jsonl").rename(out / f"train-rank{r}.jsonl")
        assert [(x["step"], x["mb"]) for x in ref[r]] == [(s, m) for s in range(STEPS) for m in range(2)]
    with EmbeddedRuntime(spec(token_sources["root"], 2), tmp_path / "run2") as rt:
        assert torchrun("titan_check.py", 2, [str(out), "resume", str(STEPS), str(SAVE_AT)], rt.client_env(), out / "log.txt") == 0, \
            (out / "log.txt").read_text()[-4000:]
    got = records(out, 2)
    for r in range(2):
        assert got[r] == [x for x in ref[r] if x["step"] >= SAVE_AT], f"rank {r}: other microbatches after the resume"
        (out / f"rec-rank{r}.jsonl").rename(out / f"resume2-rank{r}.jsonl")
    with EmbeddedRuntime(spec(token_sources["root"], 1), tmp_path / "run3") as rt:
        assert torchrun("titan_check.py", 1, [str(out), "resume", str(STEPS), str(SAVE_AT)], rt.client_env(), out / "log.txt") == 0, \
            (out / "log.txt").read_text()[-4000:]
    one = rows_by_step(records(out, 1))
    want = rows_by_step(ref)
    assert sorted(one) == list(range(SAVE_AT, STEPS))
    for s in one:
        assert np.array_equal(one[s], want[s]), f"step {s}: the DP=1 job got another global batch"
