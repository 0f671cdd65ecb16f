"""MixtureLoader.state_dict / load_state_dict through the resume harness (tests/resume_harness.py),
against a real embedded runtime (planner, loaders, constructor processes over ZeroMQ): resuming at
any step, before or after a source wraps into its next epoch, delivers exactly the uninterrupted run."""

from __future__ import annotations

import numpy as np
import pytest

from mixplane.client import STATE_VERSION, MixtureLoader
from mixplane.runtime import EmbeddedRuntime
from mixplane.samples import key_epoch
from mixplane.spec import parse_spec
from tests.conftest import write_token_source
from tests.resume_harness import Resumable, check_save_load_state

pytestmark = pytest.mark.timeout(300)
FROM_START = {"version": STATE_VERSION, "next_step": 0, "cursor": None}  # a state saved before the first step


class Trainer:
    """One rank's loader. Every fresh one restarts the run at step 0 (a RESUME to the initial
    cursor), so the same runtime serves the reference, the saving run and the restored runs."""

    def __init__(self, endpoint: str):
        self.loader = MixtureLoader(endpoint, rank=0, timeout_s=60)
        self.loader.load_state_dict(FROM_START)
        self.it = None

    def next_batch(self):
        if self.it is None:
            self.it = iter(self.loader)
        b = next(self.it)
        return tuple((k, b[k].numpy().tobytes(), tuple(b[k].shape), b[k].numpy().dtype.str) for k in sorted(b))

    def save(self):
        return self.loader.state_dict()

    def load(self, state):
        self.loader.load_state_dict(state)


def tiny_epochs(item) -> set[int]:
    b = {k: np.frombuffer(v, np.dtype(dt)) for k, v, _, dt in item}
    src, keys = b["segment_source"], b["segment_key"]
    assert len(src) == len(keys)
    return set(key_epoch(keys[src == 0]).tolist())


@pytest.mark.parametrize("shuffle", ["page", "rowgroup", "blocks"])
def test_mixture_loader_resumes_exactly_across_epochs(tmp_path, shuffle):
    # blocks: both sources read block by block (the tiny one: 5 files in blocks of 2, so epochs cross blocks)
    more = {"lazy_index_files": 4, "block_files": 2} if shuffle == "blocks" else {}
    write_token_source(tmp_path / "tiny", rows=50, files=5 if more else 2, mean_len=40, seed=5, rows_per_group=16)
    write_token_source(tmp_path / "big", rows=1500, files=6 if more else 1, mean_len=60, seed=6)
    spec = parse_spec({
        "name": "resume-harness",
        "sources": [{"name": n, "uri": str(tmp_path / n), "kind": "tokens", "columns": ["tokens"],
                     "shuffle": "page" if more else shuffle, **more} for n in ("tiny", "big")],
        "mixture": {"weights": {"tiny": 0.5, "big": 0.5}, "seed": 3},
        "batch": {"sequences": 4, "seq_len": 128, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 1}}},
        "strategy": {"name": "vanilla"},
        "runtime": {"window": 8, "metrics": False},
    })
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        ep = rt.planner_endpoint
        check_save_load_state(
            Resumable(make=lambda: Trainer(ep), next_item=Trainer.next_batch, save=Trainer.save, load=Trainer.load,
                      close=lambda t: t.loader.close(), epoch_of=tiny_epochs),
            total=14, midpoints=[2, 11])
