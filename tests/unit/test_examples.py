"""Every shipped example mixture is valid (data files are checked by the integration demo run)."""

from pathlib import Path

import pytest

from mixplane.spec import load_spec

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= {"demo.yaml", "curriculum.yaml", "llm-long-short.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid(path):
    spec = load_spec(path)
    assert spec.sources and spec.tokens_per_step > 0
