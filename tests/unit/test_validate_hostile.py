"""`mixplane validate` on hostile and odd input: exit 2 and `FILE: field.path: message` lines, never a traceback.

Also: every problem at once (shape and cross-field rules together), the machine bounds name their bound, and
a source with no readable file is a validation problem unless --no-files.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mixplane import spec as S
from mixplane.cli import main
from tests.conftest import token_mixture

LINE = re.compile(r"^(?P<file>[^:]+): (?P<path>[^:]+): (?P<msg>.+)$")


def validate(capsys, *args: str) -> tuple[int, list[str]]:
    rc = main(["validate", *args])
    out = capsys.readouterr().out.splitlines()
    return rc, out


def problems_of(capsys, path: Path, *extra: str) -> list[tuple[str, str]]:
    """(field path, message) of every line; asserts exit 2 and the line format."""
    rc, out = validate(capsys, str(path), *extra)
    assert rc == 2 and out, out
    parsed = []
    for line in out:
        m = LINE.match(line)
        assert m and m["file"] == str(path), line
        parsed.append((m["path"], m["msg"]))
    return parsed


def write(tmp_path: Path, name: str, data: bytes | str) -> Path:
    f = tmp_path / name
    f.write_bytes(data if isinstance(data, bytes) else data.encode())
    return f


def test_binary_and_non_utf8_files(tmp_path, capsys):
    rng = __import__("random").Random(3)
    garbage = bytes(rng.randrange(256) for _ in range(4096))
    [(path, msg)] = problems_of(capsys, write(tmp_path, "bin.yaml", b"\x89PNG" + garbage))
    assert path == "line 1" and msg.startswith("not UTF-8 text (byte 0x")
    [(path, msg)] = problems_of(capsys, write(tmp_path, "latin1.yaml", "name: mix\n# caf\u00e9\n".encode("latin-1")))
    assert path == "line 2" and "byte 0xe9" in msg
    [(path, msg)] = problems_of(capsys, write(tmp_path, "nul.yaml", b"name: a\x00b\n"))
    assert msg.startswith("not valid YAML")


def test_huge_file_names_the_bound(tmp_path, capsys):
    f = write(tmp_path, "huge.yaml", b"# " + b"x" * S.MAX_SPEC_BYTES + b"\n")
    [(path, msg)] = problems_of(capsys, f)
    assert path == "<file>" and str(S.MAX_SPEC_BYTES) in msg


def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path, capsys):
    for depth in (S.MAX_YAML_DEPTH + 1, 100_000):
        f = write(tmp_path, f"deep{depth}.yaml", "a: " + "[" * depth + "]" * depth + "\n")
        [(path, msg)] = problems_of(capsys, f)
        assert path == "line 1" and f"nested more than {S.MAX_YAML_DEPTH} levels" in msg
    ok = write(tmp_path, "ok-depth.yaml", "a: " + "[" * 10 + "]" * 10 + "\n")
    assert ("a", "Extra inputs are not permitted") in problems_of(capsys, ok)  # parsed, then judged as a spec


def test_alias_bombs_and_recursive_aliases(tmp_path, capsys):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]  # 10^9 values expanded
    for name, text in (("bomb.yaml", "\n".join(lines) + "\nsources: *a8\n"), ("rec.yaml", "sources: &s [*s]\n")):
        [(path, msg)] = problems_of(capsys, write(tmp_path, name, text))
        assert path == "<file>" and f"more than the bound of {S.MAX_YAML_VALUES} YAML values" in msg


def test_odd_documents(tmp_path, capsys):
    [(path, msg)] = problems_of(capsys, write(tmp_path, "int.yaml", "batch: {seq_len: " + "9" * 5000 + "}\n"))
    assert path == "<file>" and "digits" in msg
    res = "kind: DataMixture\napiVersion: mixplane.io/v1\nmetadata: 3\nspec: [1, 2]\n"
    assert problems_of(capsys, write(tmp_path, "res.yaml", res)) == [("spec", "expected a mapping, got a list")]
    [(path, msg)] = problems_of(capsys, write(tmp_path, "list.yaml", "- 1\n- 2\n"))
    assert path == "<root>" and msg == "expected a mapping, got a list"
    [(path, _)] = problems_of(capsys, tmp_path)  # a directory
    assert path == "<file>"


def test_no_traceback_from_the_command(tmp_path):
    f = write(tmp_path, "bin.yaml", bytes(range(256)) * 8)
    r = subprocess.run([sys.executable, "-m", "mixplane.cli", "validate", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout.startswith(f"{f}: line 2: not UTF-8")  # byte 10 ends line 1


def test_shape_and_cross_field_problems_reported_together(token_sources, tmp_path, capsys):
    doc = token_mixture(token_sources["root"])
    doc["batch"]["sequences"] = 0
    doc["mixture"]["weights"]["a"] = float("nan")
    doc["sources"][1]["replicas"] = "many"
    doc["sources"][2]["uri"] = str(tmp_path / "nothing")
    got = problems_of(capsys, write(tmp_path, "mix.yaml", yaml.safe_dump(doc)))
    paths = [p for p, _ in got]
    assert "batch.sequences" in paths and "sources[1].replicas" in paths
    assert ("mixture.weights.a", "weight must be a finite number >= 0, got nan") in got
    assert any(p == "sources[2].uri" and m.startswith("matches no Parquet file") for p, m in got)
    # the rule about the value set aside is not echoed ("set exactly one of sequences or tokens")
    assert "batch" not in paths and len(got) == 4


def test_machine_bounds_name_the_bound(token_sources, tmp_path, capsys):
    doc = token_mixture(token_sources["root"])
    doc["sources"][0]["replicas"] = 100_000
    doc["runtime"]["window_max"] = 1 << 30
    got = dict(problems_of(capsys, write(tmp_path, "b1.yaml", yaml.safe_dump(doc)), "--no-files"))
    assert str(S.MAX_REPLICAS) in got["sources[0].replicas"]
    assert str(S.MAX_WINDOW) in got["runtime.window_max"]

    doc = token_mixture(token_sources["root"])
    for s in doc["sources"]:
        s["replicas"] = S.MAX_REPLICAS  # each within its bound, together too many processes
    doc["sources"] += [dict(doc["sources"][0], name=f"x{i}") for i in range(8)]
    got = dict(problems_of(capsys, write(tmp_path, "b2.yaml", yaml.safe_dump(doc)), "--no-files"))
    assert f"more than the bound of {S.MAX_COMPONENT_PROCESSES} component processes" in got["sources"]
    doc["runtime"]["sources_per_loader"] = 8  # grouping brings it under the bound
    rc, out = validate(capsys, str(write(tmp_path, "b3.yaml", yaml.safe_dump(doc))), "--no-files", "-q")
    assert rc == 0, out

    doc = token_mixture(token_sources["root"])
    doc["topology"] = {"modules": {"backbone": {"dp": 1 << 20, "tp": 2}}}
    doc["batch"] = {"sequences": 1 << 20, "seq_len": 256}
    got = dict(problems_of(capsys, write(tmp_path, "b4.yaml", yaml.safe_dump(doc)), "--no-files"))
    assert f"the bound of {S.MAX_WORLD} ranks" in got["topology.modules.backbone"]


def test_a_source_without_a_readable_file(token_sources, tmp_path, capsys):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "a.parquet").write_bytes(b"not parquet at all")
    (junk / "b.parquet").write_bytes(b"")
    doc = token_mixture(token_sources["root"])
    doc["sources"][1]["uri"] = str(junk)
    f = write(tmp_path, "junk.yaml", yaml.safe_dump(doc))
    [(path, msg)] = problems_of(capsys, f)
    assert path == "sources[1].uri" and msg.startswith("no readable Parquet file among its 2 file(s); first: ")
    assert str(junk / "a.parquet") in msg
    assert validate(capsys, str(f), "--no-files", "-q")[0] == 0
    # one readable file is enough: the loader quarantines the others
    shutil.copy(next((token_sources["root"] / "b").glob("*.parquet")), junk / "c.parquet")
    assert validate(capsys, str(f), "-q")[0] == 0


def test_every_bound_is_in_the_reference():
    names = {k for k in vars(S) if k.startswith("MAX_")}
    assert names == set(S._BOUNDED)
    ref = S.reference_markdown()
    assert all(f"`{k}`" in ref for k in names)
