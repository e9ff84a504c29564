"""docs/configuration.md is generated from the code (`python -m fedapp.reference --write`) and agrees with
pyproject.toml: every run-config key once, in its group's section, with pyproject's default and a help line."""

import re
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

from feddata import PARTITIONERS
from fedapp import registry
from fedapp.config import CommonConfig
from fedapp.options import options_of
from fedapp.reference import COMMAND, DOC

ROOT = Path(__file__).resolve().parents[1]
GROUPS = ["run", "partitioner", "espresso", "feddifrc", "fedprox", "moon", "pfdm", "dcfm", "log"]
COLUMNS = ["key", "type", "default", "allowed", "help"]


def pyproject_config() -> dict:
    def flatten(d, prefix=""):
        for k, v in d.items():
            yield from flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]

    return dict(flatten(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]))


def reference_rows() -> list[tuple[str, dict[str, str]]]:
    """(section, {column: cell}) of every table row of docs/configuration.md."""
    out, section = [], None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:]
        elif line.startswith("| ") and not line.startswith("| key |"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            assert len(cells) == len(COLUMNS), line
            row = dict(zip(COLUMNS, cells))
            row["key"] = row["key"].strip("`")
            out.append((section, row))
    return out


def test_the_committed_reference_is_what_the_command_generates():
    run = subprocess.run([sys.executable, "-m", "fedapp.reference"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == DOC.read_text(), f"docs/configuration.md is stale: run `{COMMAND}`"
    assert COMMAND in run.stdout and "--run-config" in run.stdout
    assert run.stdout.startswith("# Configuration reference\n")


def test_every_pyproject_key_appears_once_in_its_groups_section():
    rows = reference_rows()
    counts = Counter(row["key"] for _, row in rows)
    assert [k for k, n in counts.items() if n > 1] == []
    config = pyproject_config()
    assert set(config) - set(counts) == set(), "keys missing from the reference"
    assert set(counts) - set(config) == set(), "keys in the reference that pyproject.toml lacks"
    headings = re.findall(r"^## (.+)$", DOC.read_text(), re.M)
    assert sorted(headings) == sorted(GROUPS)
    for section, row in rows:
        key = row["key"]
        assert section == (key.split(".", 1)[0] if "." in key else "run"), (section, key)


def test_each_default_shown_is_pyprojects_value():
    config = pyproject_config()
    for _, row in reference_rows():
        cell = row["default"]
        assert cell.startswith("`") and cell.endswith("`"), row
        shown = tomllib.loads(f"v = {cell[1:-1]}")["v"]
        expected = config[row["key"]]
        assert (type(shown), shown) == (type(expected), expected), row["key"]
        if expected != "auto":  # an int/float field that also takes "auto" shows its scalar type
            assert row["type"] == type(expected).__name__, row["key"]


def test_every_key_has_help_and_allowed_values():
    for _, row in reference_rows():
        assert len(row["help"]) > 3 and not row["help"].startswith("(used by"), row["key"]
        assert row["allowed"], row["key"]


def test_allowed_values_are_the_codes():
    rows = {row["key"]: row for _, row in reference_rows()}
    assert rows["method"]["allowed"] == "one of " + ", ".join(repr(m) for m in registry.METHODS)
    assert rows["partitioner.name"]["allowed"] == "one of " + ", ".join(repr(p) for p in PARTITIONERS)
    classes = [("", CommonConfig)] + [(f"{ns}.", registry.options_class(ns)) for ns in registry.namespaces()]
    checked = 0
    for prefix, cls in classes:
        for key, (name, rule) in options_of(cls).items():
            allowed = rows[prefix + key]["allowed"]
            if rule.choices:
                assert allowed == "one of " + ", ".join(repr(c) for c in rule.choices), name
                checked += 1
            if rule.low is not None:
                assert f"{rule.low:g}" in allowed and (rule.high is None or f"{rule.high:g}" in allowed)
                checked += 1
    assert checked > 50
    assert rows["lr"]["allowed"] == "> 0" and rows["fraction-evaluate"]["allowed"] == "in [0, 1]"
    assert rows["image-size"]["allowed"] == "'auto' or in [8, 1024]"
