"""The table commands (`python -m experiments <name>`): asking for help or giving a bad option writes
nothing, neither under docs/ (the default --out) nor anywhere else below the working directory."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.__main__ import available

ROOT = Path(__file__).resolve().parents[1]


def _snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    # run where a user would (docs/ below the working directory), with the repository importable
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "experiments", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "espresso_ablation.json").write_text("{}\n")  # a table already there
    return tmp_path


def test_every_experiment_is_listed():
    assert available() == ["dcfm", "dcfm-toy", "espresso-ablation", "espresso-conditions", "feddifrc", "pfdm"]


@pytest.mark.parametrize("name", available())
def test_help_and_a_bad_option_write_nothing(workdir, name):
    before = _snapshot(workdir)
    helped = _run(workdir, name, "--help")
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith(f"usage: python -m experiments {name}") and "--out" in helped.stdout
    bad = _run(workdir, name, "--no-such-option")
    assert bad.returncode == 2 and "unrecognized arguments: --no-such-option" in bad.stderr
    assert _snapshot(workdir) == before


def test_a_bad_run_config_value_stops_before_writing(workdir):
    bad = _run(workdir, "espresso-ablation", "--seeds", "0", "--set", "espresso.sampler=euler")
    assert bad.returncode != 0 and "espresso.sampler='euler'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1  # one line naming key, value and what is allowed
    assert _snapshot(workdir) == {"docs/espresso_ablation.json": _snapshot(workdir)["docs/espresso_ablation.json"]}


def test_the_dispatcher_lists_experiments_and_rejects_unknown_names(workdir):
    listed = _run(workdir, "--help")
    assert listed.returncode == 0 and "espresso-ablation" in listed.stdout
    unknown = _run(workdir, "no-such-table")
    assert unknown.returncode == 1 and "must be one of" in unknown.stderr
