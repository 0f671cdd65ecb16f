"""`mixplane profile`: loader cost per token and memory per partition, measured through the loader's reader."""

from __future__ import annotations

import json

import pytest
import yaml

from mixplane.cli import main
from mixplane.operator.autopartition import (
    LoaderBudget,
    PartitionError,
    auto_partition,
    spec_schedule,
)
from mixplane.profile import costs_from_profile, profile_spec
from mixplane.spec import parse_spec

from .operator_testdata import text_image_mixture, write_text_and_images


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    root = tmp_path_factory.mktemp("prof")
    paths = write_text_and_images(root)
    doc = text_image_mixture(paths)
    (root / "mix.yaml").write_text(yaml.safe_dump(doc))
    return root, parse_spec(doc)


def test_image_text_costs_more_cpu_per_token_than_text(mix):
    _, spec = mix
    prof = profile_spec(spec, max_rows=64, max_cpu_s=1.0)
    text, pairs = prof["sources"]["text"], prof["sources"]["pairs"]
    for p in (text, pairs):
        assert p["rows"] > 0 and p["tokens"] > 0 and p["cpu_s"] > 0
        assert p["cpu_s_per_token"] == pytest.approx(p["cpu_s"] / p["tokens"])
        # at least the shuffle buffer (rows x measured bytes, capped at shuffle_buffer_mb) is counted
        assert p["memory_per_partition"] >= min(10000 * p["raw_bytes_per_row"], 32 << 20)
        assert p["max_partitions"] >= 1
    assert pairs["patches"] > 0 and text["patches"] == 0
    # decoding and resizing a 640 px JPEG for ~64 tokens is far dearer per token than BPE on plain text
    assert pairs["cpu_s_per_token"] > 3 * text["cpu_s_per_token"]
    costs = {c.name: c for c in costs_from_profile(prof)}
    assert costs["pairs"].cpu_s_per_token == pairs["cpu_s_per_token"]
    plan = auto_partition(list(costs.values()), spec_schedule(spec), 40_000, LoaderBudget(64, 64 << 30))
    assert plan.partitions["pairs"] >= plan.partitions["text"]


def test_cli_prints_and_writes_the_profile(mix, capsys):
    root, _ = mix
    out = root / "profile.json"
    assert main(["profile", str(root / "mix.yaml"), "--max-rows", "16", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert set(printed["sources"]) == {"text", "pairs"} and printed["version"] == 1


def test_a_profile_that_is_not_one_is_refused():
    with pytest.raises(PartitionError, match="not a mixplane profile"):
        costs_from_profile({"sources": {}})
    with pytest.raises(PartitionError, match="profile sources.a"):
        costs_from_profile({"version": 1, "sources": {"a": {"cpu_s_per_token": 1e-6}}})


def test_the_profile_measures_what_decode_at_auto_decides_from_and_the_slim_message_carries_it(mix):
    from mixplane.imagedecode import ImageCosts, choose_decode_place
    from mixplane.profile import parse_message, slim_entry_bound, slim_profile, termination_message
    from mixplane.profile_message import image_costs_from_profile

    _, spec = mix
    prof = profile_spec(spec, max_rows=64, max_cpu_s=1.0)
    assert "image_costs" not in prof["sources"]["text"]
    ic = prof["sources"]["pairs"]["image_costs"]
    assert ic["images"] > 0 and ic["decode_s"] > 0 and ic["raw_bytes"] > 0
    # every image decodes to whole patches of 14 x 14 x 3 bytes
    assert ic["decoded_bytes"] > 0 and ic["decoded_bytes"] * ic["images"] % (14 * 14 * 3) == pytest.approx(0, abs=1e-3)
    msg = parse_message(termination_message(prof))
    got = image_costs_from_profile(msg)
    assert set(got) == {"pairs"} and got["pairs"].images == ic["images"]
    assert got["pairs"].decode_s == pytest.approx(ic["decode_s"], rel=1e-5)
    assert choose_decode_place(got["pairs"]) == choose_decode_place(ImageCosts(**ic))
    import json
    entry = json.dumps({"pairs": slim_profile(prof)["sources"]["pairs"]}, separators=(",", ":"))
    assert len(entry) - 2 <= slim_entry_bound("pairs", image=True) and slim_entry_bound("pairs") < slim_entry_bound("pairs", image=True)
    with pytest.raises(ValueError, match="sources.pairs.image_costs: figures out of range"):
        bad = slim_profile(prof)
        bad["sources"]["pairs"]["image_costs"]["raw_bytes"] = -1.0
        parse_message(json.dumps({**bad, "version": 1}))
