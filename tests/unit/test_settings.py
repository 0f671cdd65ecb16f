"""One declaration of every environment variable (mixplane.settings): the code reads only declared names, every
declared name is read somewhere, values are typed with errors naming the variable, and docs/configuration.md is
generated from the table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mixplane import settings

SRC = Path(settings.__file__).parent
NAME = re.compile(r"MIXPLANE_[A-Z0-9_]*[A-Z0-9]")
READ = re.compile(r"settings\.get\(\"([A-Z0-9_]+)\"")  # a declared launcher variable (RANK, ...) read through get


def names_in_source() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for p in SRC.rglob("*.py"):
        if p.name == "settings.py":
            continue
        text = p.read_text()
        for n in {*NAME.findall(text), *READ.findall(text)}:
            out.setdefault(n, []).append(str(p.relative_to(SRC)))
    return out


def test_every_environment_variable_the_code_names_is_declared_and_every_declared_one_is_read():
    used = names_in_source()
    undeclared = {n: sorted(set(f)) for n, f in used.items() if n not in settings.BY_NAME}
    assert not undeclared, f"declare these in mixplane.settings.ENV: {undeclared}"
    unused = [e.name for e in settings.ENV if e.name not in used]
    assert not unused, f"declared but read nowhere: {unused}"
    assert len(settings.BY_NAME) == len(settings.ENV)  # no name twice


def test_values_are_typed_and_a_bad_one_names_the_variable():
    env = {"MIXPLANE_SCALE_INTERVAL_S": "7.5", "MIXPLANE_WEBHOOK_PORT": "8443", "MIXPLANE_GCS_ANONYMOUS": "yes",
           "MIXPLANE_IMAGE": ""}
    assert settings.get("MIXPLANE_SCALE_INTERVAL_S", env) == 7.5
    assert settings.get("MIXPLANE_WEBHOOK_PORT", env) == 8443
    assert settings.get("MIXPLANE_GCS_ANONYMOUS", env) is True
    assert settings.get("MIXPLANE_IMAGE", env) == "mixplane:latest"  # empty: the default
    assert settings.get("MIXPLANE_PROFILE_POLL_S", {}) == 5.0 and settings.get("MIXPLANE_PLANNER", {}) is None
    with pytest.raises(settings.SettingError, match="MIXPLANE_WEBHOOK_PORT='x': expected an integer"):
        settings.get("MIXPLANE_WEBHOOK_PORT", {"MIXPLANE_WEBHOOK_PORT": "x"})
    with pytest.raises(settings.SettingError, match="MIXPLANE_GCS_ANONYMOUS='maybe'"):
        settings.get("MIXPLANE_GCS_ANONYMOUS", {"MIXPLANE_GCS_ANONYMOUS": "maybe"})
    with pytest.raises(KeyError, match="MIXPLANE_NOPE is not a declared"):
        settings.get("MIXPLANE_NOPE", {})


def test_the_reference_is_generated_from_the_table():
    doc = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert doc.read_text() == settings.markdown(), "regenerate with: python -m mixplane.settings > docs/configuration.md"
