"""The options experiments' and benchmarks' commands share (experiments/cli.py): declared once as a parent parser,
never again by hand in a command, and `--threads` taking effect in one place (pin_threads)."""

from __future__ import annotations

import argparse
import ast
import os
from pathlib import Path

import pytest
import torch

from experiments import common
from experiments.cli import SHARED, common_args, pin_threads, thread_count

ROOT = Path(__file__).resolve().parents[1]
FLAGS = {"--" + dest.replace("_", "-") for dest in SHARED}
# a command's own option under a shared flag's name, because it means something else there
OWN_MEANING = {("experiments/dcfm_toy.py", "--seeds"): "a count N: seeds 0..N-1",
               ("experiments/espresso_ablation.py", "--seeds"): "space-separated seeds (--seeds 0 1 2)"}
# not moved onto common_args yet: each entry goes when its file is (the test below fails on a stale one)
NOT_YET: set[tuple[str, str]] = set()


def _commands() -> list[Path]:
    return sorted(p for folder in ("experiments", "benchmarks") for p in (ROOT / folder).glob("*.py")
                  if p.name != "cli.py")


def _calls(source: str, name: str) -> list[ast.Call]:
    """Calls of `name(...)` or `<x>.name(...)` in `source`."""
    return [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
            and name in (getattr(n.func, "attr", None), getattr(n.func, "id", None))]


def hand_declared(source: str) -> set[str]:
    """The shared flags `source` declares itself: a string argument of any `<parser>.add_argument(...)` call."""
    return {a.value for c in _calls(source, "add_argument") for a in c.args
            if isinstance(a, ast.Constant) and a.value in FLAGS}


def test_the_scan_finds_a_flag_declared_by_hand():
    assert hand_declared('ap.add_argument("-o", "--out", default="x")\np.add_argument("--lr")') == {"--out"}
    assert hand_declared('p = argparse.ArgumentParser(parents=[common_args(out="x")])') == set()


def test_no_command_declares_a_shared_option_by_hand():
    found = {(str(p.relative_to(ROOT)), f) for p in _commands() for f in hand_declared(p.read_text())}
    assert found - OWN_MEANING.keys() - NOT_YET == set()
    assert (OWN_MEANING.keys() | NOT_YET) - found == set(), "stale entries: drop them from the lists above"


def test_threads_take_effect_through_pin_threads_alone():
    """A command offering the shared --threads calls pin_threads, and nobody sets torch's threads from --threads
    by hand (scale.py pins a fixed count of its own)."""
    by_hand, unpinned = [], []
    for path in _commands():
        source, rel = path.read_text(), str(path.relative_to(ROOT))
        if any(k.arg == "threads" for c in _calls(source, "common_args") for k in c.keywords) \
                and not _calls(source, "pin_threads"):
            unpinned.append(rel)
        if any(isinstance(a, ast.Attribute) and a.attr == "threads" for c in _calls(source, "set_num_threads")
               for a in c.args):
            by_hand.append(rel)
    assert unpinned == []
    assert by_hand == sorted(f for f, flag in NOT_YET if flag == "--threads")


def test_common_args_offers_the_named_options_at_their_defaults():
    p = argparse.ArgumentParser(parents=[common_args(runs_dir="runs/x", threads=2, set=["dataset=a"])])
    assert vars(p.parse_args([])) == {"set": ["dataset=a"], "runs_dir": "runs/x", "threads": 2}
    a = p.parse_args(["--runs-dir", "r", "--threads", "0", "--set", "model=cnn", "local-epochs=2"])
    assert (a.runs_dir, a.threads, a.set) == ("r", 0, ["model=cnn", "local-epochs=2"])
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--out", "x"])  # not named: not offered
    assert e.value.code == 2


def test_each_parser_gets_its_own_defaults_and_help():
    defaults = ["dataset=a"]
    first = argparse.ArgumentParser(parents=[common_args(set=defaults, out="docs/results")])
    first.parse_args([]).set.append("model=cnn")
    assert defaults == ["dataset=a"]  # the caller's list is not the parser's default
    second = argparse.ArgumentParser(parents=[common_args(out="wheels", helps={"out": "folder for the wheels"})])
    assert second.parse_args([]).out == "wheels" and "folder for the wheels" in second.format_help()
    assert "folder for the wheels" not in first.format_help()


def test_common_args_refuses_what_it_does_not_share():
    with pytest.raises(TypeError, match="lr: not a shared option"):
        common_args(lr=0.1)
    with pytest.raises(TypeError, match="out: not a shared option given a default"):
        common_args(threads=1, helps={"out": "x"})


@pytest.mark.parametrize("text", ["-1", "two", "1.5"])
def test_threads_must_be_a_count(text):
    with pytest.raises(argparse.ArgumentTypeError, match=rf"--threads='{text}': must be 0 .* or a positive count"):
        thread_count(text)
    p = argparse.ArgumentParser(parents=[common_args(threads=1)])
    with pytest.raises(SystemExit):
        p.parse_args(["--threads", text])
    assert thread_count("0") == 0 and thread_count("3") == 3


def test_pin_threads_sets_torch_and_omp_or_refuses_to_oversubscribe(monkeypatch):
    monkeypatch.setattr(common, "available_cpus", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        pin_threads(0)  # torch's default: left as it is
        assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
        pin_threads(1)
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
        with pytest.raises(SystemExit, match=r"--jobs 2 x --threads 2 = 4 threads > 2 CPU cores"):
            pin_threads(2, jobs=2)
        assert torch.get_num_threads() == 1  # refused before anything changed
    finally:
        torch.set_num_threads(before)
