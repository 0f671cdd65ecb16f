"""Every validation rule of the DataMixture spec, and `mixplane validate`'s output contract."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mixplane.checks import default_checks
from mixplane.spec import SpecError, load_spec, parse_spec, reference_markdown
from tests.conftest import token_mixture


def problems(doc: dict, files: bool = True) -> list[str]:
    """Every problem `mixplane validate` reports (files=False: --no-files)."""
    try:
        parse_spec(doc, checks=default_checks(files))
    except SpecError as e:
        return [str(p) for p in e.problems]
    return []


@pytest.fixture()
def good(token_sources) -> dict:
    return token_mixture(token_sources["root"])


def test_valid_mixture_has_no_problems(good):
    assert problems(good) == []
    spec = parse_spec(good)
    assert spec.rows_per_microbatch == 2 and spec.world_size == 2 and spec.tokens_per_step == 8 * 256


def test_defaults_are_applied(token_sources):
    doc = token_mixture(token_sources["root"])
    del doc["mixture"]
    del doc["topology"]
    del doc["strategy"]
    for s in doc["sources"]:
        del s["shuffle"]  # the fixture sets it; the default is what this test is about
    doc["batch"] = {"sequences": 4, "seq_len": 128}
    spec = parse_spec(doc)
    assert spec.mixture.temperature == 1.0 and spec.mixture.unit == "tokens"
    assert spec.batch.packing == "best_fit" and spec.batch.microbatches == 1
    assert spec.topology.backbone()[1].dp == 1
    assert [s.shuffle for s in spec.sources] == ["page"] * 3 and spec.sources[1].replicas == 1
    assert spec.sources[0].live is False and spec.strategy.name == "llm_balance"


def test_duplicate_source_names(good):
    good["sources"][1]["name"] = "a"
    assert any(p.startswith("sources[1].name: duplicate source name 'a'") for p in problems(good))


def test_unknown_source_in_weights(good):
    good["mixture"]["weights"]["zzz"] = 1.0
    assert "mixture.weights.zzz: unknown source 'zzz' (sources: a, b, c)" in problems(good)


def test_negative_weight(good):
    good["mixture"]["weights"]["b"] = -0.1
    assert any(p.startswith("mixture.weights.b: weight must be a finite number >= 0") for p in problems(good))


def test_weights_need_positive_sum(good):
    good["mixture"]["weights"] = {"a": 0, "b": 0, "c": 0}
    assert "mixture.weights: weights must have a positive sum" in problems(good)


def test_temperature_must_be_positive(good):
    good["mixture"]["temperature"] = 0
    assert "mixture.temperature: temperature must be a finite number > 0, got 0.0" in problems(good)


@pytest.mark.parametrize("t", [float("inf"), float("nan")])
def test_temperature_must_be_finite(good, t):
    good["mixture"]["temperature"] = t
    assert any(p.startswith("mixture.temperature: temperature must be a finite number > 0, got ") for p in problems(good))


def test_phases_strictly_increasing(good):
    good["mixture"]["phases"] = [{"start_step": 100, "weights": {"a": 1}}, {"start_step": 100, "weights": {"b": 1}}]
    assert "mixture.phases[1].start_step: start_step must be strictly increasing (100 after 100)" in problems(good)


def test_phase_lr_scale_positive(good):
    good["mixture"]["phases"] = [{"start_step": 10, "weights": {"a": 1}, "lr_scale": 0}]
    assert "mixture.phases[0].lr_scale: lr_scale must be a finite number > 0, got 0.0" in problems(good)


@pytest.mark.parametrize("lr", [float("inf"), float("nan"), -1.0])
def test_phase_lr_scale_must_be_finite_and_positive(good, lr):
    good["mixture"]["phases"] = [{"start_step": 10, "weights": {"a": 1}, "lr_scale": lr}]
    assert f"mixture.phases[0].lr_scale: lr_scale must be a finite number > 0, got {lr}" in problems(good)


@pytest.mark.parametrize("lr", [0.0, -0.5, float("inf"), float("nan")])
def test_anneal_lr_scale_must_be_finite_and_positive(good, lr):
    good["mixture"]["anneal"] = {"start_step": 20, "weights": {"b": 1}, "lr_scale": lr}
    assert problems(good) == [f"mixture.anneal.lr_scale: lr_scale must be a finite number > 0, got {lr}"]


def test_anneal_names_only_known_sources(good):
    good["mixture"]["anneal"] = {"start_step": 20, "weights": {"b": 1, "web": 1}}
    assert problems(good) == ["mixture.anneal.weights.web: unknown source 'web' (sources: a, b, c)"]


def test_negative_weight_in_a_phase(good):
    good["mixture"]["phases"] = [{"start_step": 10, "weights": {"a": -1, "b": 2}}]
    assert problems(good) == ["mixture.phases[0].weights.a: weight must be a finite number >= 0, got -1.0"]


def test_negative_weight_in_anneal(good):
    good["mixture"]["anneal"] = {"start_step": 20, "weights": {"a": 1, "c": -0.5}}
    assert problems(good) == ["mixture.anneal.weights.c: weight must be a finite number >= 0, got -0.5"]


def test_phase_weights_need_positive_sum(good):
    good["mixture"]["phases"] = [{"start_step": 10, "weights": {"a": 0, "b": 0, "c": 0}}]
    assert problems(good) == ["mixture.phases[0].weights: weights must have a positive sum"]


@pytest.mark.parametrize("w", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["base", "phase", "anneal"])
def test_non_finite_weights_are_rejected(good, w, where):
    if where == "base":
        good["mixture"]["weights"]["b"] = w
        path = "mixture.weights.b"
    elif where == "phase":
        good["mixture"]["phases"] = [{"start_step": 10, "weights": {"b": w}}]
        path = "mixture.phases[0].weights.b"
    else:
        good["mixture"]["anneal"] = {"start_step": 20, "weights": {"a": 1, "b": w}}
        path = "mixture.anneal.weights.b"
    assert f"{path}: weight must be a finite number >= 0, got {w}" in problems(good)


def test_phase_names_only_known_sources(good):
    good["mixture"]["phases"] = [{"start_step": 10, "weights": {"web": 1}}]
    assert any(p.startswith("mixture.phases[0].weights.web: unknown source 'web'") for p in problems(good))


def test_phases_and_anneal_exclusive(good):
    good["mixture"]["phases"] = [{"start_step": 10, "weights": {"a": 1}}]
    good["mixture"]["anneal"] = {"start_step": 20, "weights": {"b": 1}}
    assert "mixture.anneal: phases and anneal cannot both be set" in problems(good)


def test_anneal_needs_positive_weights(good):
    names = [s["name"] for s in good["sources"]]
    good["mixture"]["anneal"] = {"start_step": 20, "weights": {n: 0 for n in names}}
    assert "mixture.anneal.weights: weights must have a positive sum" in problems(good)
    # sources the anneal does not name keep their base weight (seed 002), so zeroing one is fine
    good["mixture"]["anneal"] = {"start_step": 20, "weights": {names[1]: 0}}
    assert problems(good) == []


def test_place_tree_broadcast_is_tp_pp_or_cp(good):
    good["strategy"]["options"] = {"place_tree": {"broadcast": ["tp", "pp", "cp"]}}
    assert problems(good) == []
    good["strategy"]["options"] = {"place_tree": {"broadcast": ["tp", "dp"]}}
    assert problems(good) == ["strategy.options.place_tree.broadcast: only tp, pp and cp can be broadcast by the "
                              "trainer (got ['tp', 'dp']; DP replicas receive different data)"]


def test_seq_len_positive(good):
    good["batch"]["seq_len"] = 0
    assert "batch.seq_len: seq_len must be > 0, got 0" in problems(good)


def test_batch_sequences_or_tokens(good):
    good["batch"]["tokens"] = 4096
    assert "batch: set exactly one of sequences or tokens" in problems(good)
    del good["batch"]["sequences"]
    good["batch"]["tokens"] = 1000
    assert "batch.tokens: tokens (1000) must be a multiple of seq_len (256)" in problems(good)


def test_batch_divides_into_ranks_and_microbatches(good):
    good["batch"]["sequences"] = 6
    assert "batch: 6 sequences per step do not divide into dp (2) x microbatches (2)" in problems(good)


def test_world_size_consistent_between_modules(good):
    good["topology"] = {"modules": {"backbone": {"dp": 2, "tp": 2}, "encoder": {"dp": 2}}}
    good["sources"][0]["kind"] = "image_text"
    out = problems(good, files=False)
    assert "topology.modules.encoder: world size 2 (dp*pp*cp*tp) differs from module 'backbone' (4)" in out


def test_cp_needs_even_split(good):
    good["topology"] = {"modules": {"backbone": {"dp": 2, "cp": 3}}}
    assert "batch.seq_len: seq_len (256) must be a multiple of 2 x cp (6) for the zig-zag split" in problems(good)


def test_files_that_match_nothing(good, tmp_path):
    good["sources"][2]["uri"] = str(tmp_path / "nothing" / "*.parquet")
    assert f"sources[2].uri: matches no Parquet file: {tmp_path / 'nothing' / '*.parquet'}" in problems(good)


def test_live_source_cannot_have_replicas(good, tmp_path):
    good["sources"][2]["live"] = True
    good["sources"][2]["replicas"] = 2
    out = problems(good)
    assert len(out) == 1 and out[0].startswith("sources[2].replicas: a live source must have 1 replica, got 2")
    good["sources"][2]["live"] = False
    assert problems(good) == []  # replicas of a fixed source partition it disjointly


def test_place_tree_override_keys_are_checked(good):
    good["strategy"]["options"] = {"place_tree": {"brodcast": ["tp"], "order": ["tp", "cp", "dp", "pp"],
                                                  "modules": {"backbone": {"rank_mapp": [1, 0]}, "vit": {}}}}
    out = problems(good)
    assert ("strategy.options.place_tree.brodcast: unknown key 'brodcast' (allowed: order, modules, rank_map, "
            "constructors, broadcast, ranks_per_node, function)") in out
    assert "strategy.options.place_tree.modules.backbone.rank_mapp: unknown key 'rank_mapp' (allowed: order, rank_map)" in out
    assert "strategy.options.place_tree.modules.vit: unknown module 'vit' (modules: backbone)" in out
    assert len(out) == 3


def test_place_tree_override_must_be_a_mapping(good):
    good["strategy"]["options"] = {"place_tree": ["tp"]}
    assert any(p.startswith("strategy.options.place_tree: expected a mapping") for p in problems(good))


def test_valid_place_tree_override_passes(good):
    good["strategy"]["options"] = {"place_tree": {"broadcast": ["tp"], "modules": {"backbone": {"order": ["tp", "cp", "dp", "pp"]}}}}
    assert problems(good) == []


def test_live_source_may_start_empty(good, tmp_path):
    good["sources"][2]["uri"] = str(tmp_path / "later" / "*.parquet")
    good["sources"][2]["live"] = True
    assert problems(good) == []


def test_missing_column_names_the_file(good, token_sources):
    good["sources"][0]["columns"] = ["text"]
    out = problems(good)
    assert len(out) == 1 and out[0].startswith("sources[0].columns[0]: column 'text' not in ") and "(has: tokens, id)" in out[0]


def test_text_source_needs_tokenizer(good):
    good["sources"][0]["kind"] = "text"
    assert "sources[0].tokenizer: kind text needs a tokenizer" in problems(good)


def test_tokenizer_file_must_exist(good, tmp_path):
    good["sources"][0]["kind"] = "text"
    good["sources"][0]["tokenizer"] = str(tmp_path / "missing.json")
    assert f"sources[0].tokenizer: no such file: {tmp_path / 'missing.json'}" in problems(good)


def test_unknown_strategy(good):
    good["strategy"] = {"name": "magic"}
    assert any(p.startswith("strategy.name: unknown strategy 'magic'") for p in problems(good))
    good["strategy"] = {"name": "nonexistent_pkg.mod:fn"}
    assert any(p.startswith("strategy.name: strategy 'nonexistent_pkg.mod:fn': cannot import: ModuleNotFoundError")
               for p in problems(good))


def test_user_strategy_files_are_loaded_as_the_planner_loads_them(good, tmp_path):
    """A strategy file that does not import, lacks the function, or does not take the spec's options is a
    validation problem naming strategy.name — not a traceback when the planner starts."""
    broken = tmp_path / "broken.py"
    broken.write_text("def plan(ctx:\n")  # SyntaxError
    ok = tmp_path / "ok.py"
    ok.write_text("def plan(ctx, method='greedy'):\n    return ctx.graph().plan()\n")
    good["strategy"] = {"name": f"{broken}:plan"}
    assert any(p.startswith(f"strategy.name: strategy '{broken}:plan': cannot import: SyntaxError") for p in problems(good))
    good["strategy"] = {"name": f"{ok}:missing"}
    assert any(p.startswith(f"strategy.name: strategy '{ok}:missing': cannot import: AttributeError") for p in problems(good))
    good["strategy"] = {"name": f"{ok}:plan", "options": {"methd": "kk"}}
    assert problems(good) == [f"strategy.name: strategy '{ok}:plan' does not accept option(s) methd (it takes: method)"]
    good["strategy"] = {"name": f"{ok}:plan", "options": {"method": "karmarkar_karp"}}
    assert problems(good) == []


def test_type_errors_name_the_field(good):
    good["batch"]["microbatches"] = "two"
    good["sources"][1]["replicas"] = 0
    out = problems(good)
    assert any(p.startswith("batch.microbatches: ") for p in out)
    assert any(p.startswith("sources[1].replicas: ") for p in out)


def test_unknown_fields_are_rejected(good):
    good["mixture"]["wieghts"] = {"a": 1}
    assert any(p.startswith("mixture.wieghts: ") for p in problems(good))


def test_bad_source_name(good):
    good["sources"][0]["name"] = "Web_Data"
    assert any(p.startswith("sources[0].name: ") for p in problems(good))


def test_custom_resource_form_prefixes_paths(good):
    cr = {"apiVersion": "mixplane.dev/v1alpha1", "kind": "DataMixture", "metadata": {"name": "cr"}, "spec": good}
    good["mixture"]["temperature"] = -1
    out = problems(cr)
    assert any(p.startswith("spec.mixture.temperature: ") for p in out)


def test_all_problems_reported_at_once(good):
    good["mixture"]["weights"]["zzz"] = 1
    good["mixture"]["temperature"] = 0
    good["batch"]["sequences"] = 6
    assert len(problems(good)) == 3


def test_relative_paths_resolve_against_the_file(token_sources, tmp_path):
    doc = token_mixture(token_sources["root"])
    for s in doc["sources"]:
        s["uri"] = str(Path(s["uri"]).relative_to(token_sources["root"]))
    f = token_sources["root"] / "mix.yaml"
    f.write_text(yaml.safe_dump(doc))
    spec = load_spec(f)
    assert spec.sources[0].uri == str(token_sources["root"] / "a")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mixplane.cli", *args], capture_output=True, text=True, timeout=60)


def test_cli_validate_exit_codes_and_format(token_sources, tmp_path):
    ok = tmp_path / "ok.yaml"
    ok.write_text(yaml.safe_dump(token_mixture(token_sources["root"])))
    r = run_cli("validate", str(ok))
    assert r.returncode == 0 and r.stdout == ""

    bad_doc = token_mixture(token_sources["root"])
    bad_doc["mixture"]["weights"]["zzz"] = 1
    bad_doc["batch"]["seq_len"] = -5
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(bad_doc))
    r = run_cli("validate", str(bad))
    assert r.returncode == 2
    lines = r.stdout.strip().splitlines()
    assert f"{bad}: mixture.weights.zzz: unknown source 'zzz' (sources: a, b, c)" in lines
    assert f"{bad}: batch.seq_len: seq_len must be > 0, got -5" in lines
    assert all(line.startswith(f"{bad}: ") for line in lines)


def test_cli_validate_reports_broken_yaml(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("sources: [\n  - name: a\n")
    r = run_cli("validate", str(f))
    assert r.returncode == 2 and r.stdout.startswith(f"{f}: line ")


def test_reference_doc_is_in_sync():
    doc = Path(__file__).resolve().parents[2] / "docs" / "spec-reference.md"
    assert doc.read_text() == reference_markdown(), "regenerate with: python -m mixplane.spec --markdown > docs/spec-reference.md"


SRC = str(Path(__file__).resolve().parents[2] / "src")


def run_cli_in(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`mixplane` run from `cwd`, so relative file names reach it exactly as a user types them."""
    env = {**__import__("os").environ, "PYTHONPATH": SRC}
    return subprocess.run([sys.executable, "-m", "mixplane.cli", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd, env=env)


@pytest.mark.parametrize("text, line", [
    ("", "<root>: expected a mapping, got an empty document"),
    ("- a\n- b\n", "<root>: expected a mapping, got a list"),
    ("apiVersion: mixplane.dev/v1alpha1\nkind: Job\nspec: {}\n", "kind: expected DataMixture, got 'Job'"),
])
def test_cli_validate_root_problems_name_the_file_as_typed(tmp_path, text, line):
    (tmp_path / "x.yaml").write_text(text)
    r = run_cli_in(tmp_path, "validate", "./x.yaml")
    assert r.returncode == 2
    assert r.stdout.splitlines() == [f"./x.yaml: {line}"]


def test_cli_validate_keeps_the_typed_name_for_field_problems(token_sources, tmp_path):
    doc = token_mixture(token_sources["root"])
    doc["mixture"]["temperature"] = float("inf")
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(doc))
    r = run_cli_in(tmp_path, "validate", "./t.yaml")
    assert r.returncode == 2
    assert r.stdout.splitlines() == ["./t.yaml: mixture.temperature: temperature must be a finite number > 0, got inf"]


def test_load_spec_root_problem_carries_the_origin(tmp_path):
    f = tmp_path / "empty.yaml"
    f.write_text("")
    with pytest.raises(SpecError) as e:
        load_spec(f)
    assert e.value.origin == str(f) and str(e.value) == f"{f}: <root>: expected a mapping, got an empty document"


def test_readme_quickstart_mixture_is_valid():
    """The README's mixture must validate, and its loop (every rank reads input_ids and labels) needs pure DP."""
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", readme, flags=re.S)
    assert len(blocks) == 1
    spec = parse_spec(yaml.safe_load(blocks[0]))
    _, bb = spec.topology.backbone()
    assert (bb.tp, bb.pp, bb.cp) == (1, 1, 1) and spec.world_size == bb.dp
    assert "tp_group=" in readme and "meta_only" in readme


def test_an_adaptive_mixture_is_checked_field_by_field(good):
    good["mixture"]["adaptive"] = {"every_steps": 50, "reference_loss": {"a": 2.0, "c": 1.5}, "min_weight": 0.1}
    assert problems(good) == []
    assert parse_spec(good).mixture.adaptive.delay_steps is None
    good["mixture"]["adaptive"] = {"every_steps": 50, "reference_loss": {"web": 2.0, "b": float("inf")},
                                   "min_weight": 0.5, "max_change": 0.0, "smoothing": 1.0}
    good["mixture"]["phases"] = [{"start_step": 10, "weights": {"a": 1}}]
    assert problems(good) == [
        "mixture.adaptive: an adaptive mixture cannot have phases or an anneal (the next phase would replace the "
        "adapted weights)",
        "mixture.adaptive.smoothing: smoothing must be in [0, 1), got 1.0",
        "mixture.adaptive.min_weight: min_weight 0.5 <= 1/3 <= max_weight 1.0 <= 1 does not hold",
        "mixture.adaptive.max_change: max_change must be in (0, 1], got 0.0",
        "mixture.adaptive.reference_loss.web: reference_loss.web: unknown source",
        "mixture.adaptive.reference_loss.b: reference_loss.b must be a finite number >= 0, got inf"]
    good["mixture"].pop("phases")
    good["mixture"]["adaptive"] = {"every_steps": 0, "method": "ado"}
    assert sorted(p.split(":")[0] for p in problems(good)) == ["mixture.adaptive.every_steps", "mixture.adaptive.method"]


def test_source_workers_are_validated_with_their_field(good):
    """sources[].workers: an integer in [1, 64] or 'auto'; anything else is named with its field path."""
    assert parse_spec(good).sources[0].workers == 1  # the default: the loader's own thread only
    for bad in (0, 65, "four", 2.5, True, None):
        good["sources"][1]["workers"] = bad
        out = problems(good)
        assert len(out) == 1 and out[0].startswith("sources[1].workers: "), (bad, out)
        assert "[1, 64] or 'auto'" in out[0], out
    for ok in (1, 4, 64, "auto"):
        good["sources"][1]["workers"] = ok
        assert problems(good) == []
        assert parse_spec(good).sources[1].workers == ok
