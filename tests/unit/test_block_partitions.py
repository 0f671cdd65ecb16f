"""A source read block by block (`sources[].lazy_index_files`) can be split into at most its number of blocks: a
spec asking more is a validation problem naming the source, its files, blocks and block_files (`mixplane validate`,
`mixplane run`'s checks, the runtime's re-partition) instead of loaders failing at start."""

from __future__ import annotations


import pytest
import yaml

from mixplane.checks import block_partition_problem, default_checks, partition_problem
from mixplane.loader.stream import StreamError, open_stream
from mixplane.spec import SpecError, parse_spec
from tests.conftest import token_mixture


def _doc(root, replicas: int, lazy_index_files: int, block_files: int = 2) -> dict:
    doc = token_mixture(root)
    doc["sources"][0].update(shuffle="page", replicas=replicas, lazy_index_files=lazy_index_files,
                             block_files=block_files)
    return doc


def _problems(doc: dict) -> list[str]:
    try:
        parse_spec(doc, checks=default_checks())
    except SpecError as e:
        return [str(p) for p in e.problems]
    return []


def test_more_partitions_than_blocks_is_a_problem_of_replicas_naming_files_blocks_and_block_files(token_sources):
    root = token_sources["root"]  # source a: 3 files; blocks of 2 files: 2 blocks
    (why,) = _problems(_doc(root, 3, 2))
    assert why.startswith("sources[0].replicas: source 'a' is read block by block (3 files listed >= "
                          "lazy_index_files 2): 2 blocks of block_files 2 files cannot be split into 3 partitions"), why
    assert _problems(_doc(root, 2, 2)) == []
    assert _problems(_doc(root, 3, 2, block_files=1)) == []  # 3 blocks of 1 file
    # under the threshold the source is read in page order: only its index can tell (the loader's own check)
    assert _problems(_doc(root, 3, 4)) == []


def test_the_check_agrees_with_the_loader(token_sources):
    """What validation refuses is what a loader of that split fails with at start, and what it accepts opens."""
    spec = parse_spec(_doc(token_sources["root"], 1, 2))
    src = spec.sources[0]
    assert block_partition_problem(src, 3, 3) is not None and block_partition_problem(src, 3, 2) is None
    # the loaders of partitions 0 and 1 would start; the one of partition 2 has no block
    open_stream(src, seed=7, partition=1, num_partitions=3, cache_dir=None).close()
    with pytest.raises(StreamError, match="2 blocks of 2 files cannot be split into 3 partitions"):
        open_stream(src, seed=7, partition=2, num_partitions=3, cache_dir=None)
    open_stream(src, seed=7, partition=1, num_partitions=2, cache_dir=None).close()


def test_the_runtimes_repartition_check(token_sources):
    spec = parse_spec(_doc(token_sources["root"], 1, 2))
    assert "2 blocks of block_files 2 files cannot be split into 3 partitions" in partition_problem(spec.sources[0], 3, 7)
    assert partition_problem(spec.sources[0], 2, 7) is None
    paged = parse_spec(_doc(token_sources["root"], 1, 0)).sources[0]  # lazy_index_files 0: page order, its index
    assert "cannot be split into 1000 partitions" in (partition_problem(paged, 1000, 7) or "")
    assert partition_problem(paged, 2, 7) is None


def test_cli_validate_reports_it(token_sources, tmp_path, capsys):
    from mixplane.cli import main

    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(_doc(token_sources["root"], 3, 2)))
    assert main(["validate", str(path)]) == 2  # invalid spec
    assert capsys.readouterr().out.splitlines() == [
        f"{path}: sources[0].replicas: source 'a' is read block by block (3 files listed >= lazy_index_files 2): 2 "
        "blocks of block_files 2 files cannot be split into 3 partitions; use at most 2 partitions or a smaller "
        "block_files"]


def test_cli_run_refuses_it_before_starting_anything(token_sources, tmp_path, capsys):
    from mixplane.cli import main

    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(_doc(token_sources["root"], 3, 2)))
    with pytest.raises(SystemExit) as e:
        main(["run", str(path), "--run-dir", str(tmp_path / "run")])
    assert e.value.code == 2 and not (tmp_path / "run").exists()
    assert "sources[0].replicas: source 'a' is read block by block" in capsys.readouterr().err
