"""The table commands (`python -m experiments <name>`): asking for help or giving a bad option writes
nothing, neither under docs/results/ (the default --out) nor anywhere else below the working directory."""

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
    # run where a user would (docs/results/ below the working directory), with the repository importable
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "experiments", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "espresso_ablation.json").write_text("{}\n")  # a table already there
    return tmp_path


def test_every_experiment_is_listed():
    assert available() == ["dcfm", "dcfm-budget", "dcfm-toy", "espresso-ablation", "espresso-conditions", "feddifrc",
                           "feddifrc-budget", "feddifrc-signal", "leaderboard", "pfdm", "pfdm-budget", "pfdm-handover",
                           "privacy-audit", "recipe", "vae-round-trip"]


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
    table = "docs/results/espresso_ablation.json"
    assert _snapshot(workdir) == {table: _snapshot(workdir)[table]}


def test_the_dispatcher_lists_experiments_and_rejects_unknown_names(workdir):
    listed = _run(workdir, "--help")
    assert listed.returncode == 0 and "espresso-ablation" in listed.stdout
    unknown = _run(workdir, "no-such-table")
    assert unknown.returncode == 1 and "must be one of" in unknown.stderr


def test_dcfm_table_summarises_each_method_and_split_over_its_seeds():
    from experiments.dcfm import summarise

    rows = [{"method": "dcfm-a", "split": "iid", "seed": s, "novel_distance": d, "seen_distance": 1.0}
            for s, d in ((0, 2.0), (1, 4.0), (2, 6.0))] + [{"method": "ddm", "split": "iid", "seed": 0,
                                                           "novel_distance": 9.0}]
    cells = {(c["method"], c["split"]): c for c in summarise(rows)}
    assert set(cells) == {("dcfm-a", "iid"), ("ddm", "iid")}
    a = cells["dcfm-a", "iid"]
    assert a["seeds"] == [0, 1, 2] and a["novel_distance"] == 4.0
    assert abs(a["novel_distance_seed_std"] - (8 / 3) ** 0.5) < 1e-12 and a["seen_distance_seed_std"] == 0.0
    assert cells["ddm", "iid"]["novel_distance_seed_std"] == 0.0 and "seen_distance" not in cells["ddm", "iid"]


def test_pfdm_eps_curve_points_map_to_the_run_config_and_inf_is_the_lowest_level():
    import argparse

    from experiments.pfdm import curve_epsilon, eps_config

    assert eps_config(10.0) == {"pfdm.epsilon": 10.0, "pfdm.t0": 0}  # pfdm.t0 = 0: epsilon picks t0
    assert eps_config(curve_epsilon("inf")) == {"pfdm.t0": 1}
    for bad in ("0", "-3"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be > 0 or inf"):
            curve_epsilon(bad)


def test_pfdm_eps_curve_plot_takes_rows_as_saved(tmp_path):
    from experiments.pfdm import plot_eps_curve

    def row(eps, t0, kid):
        return {"epsilon": eps, "t0": t0, **{f"{p}{g}_kid{s}": kid for p in ("", "private_only_")
                                             for g in ("minority", "majority") for s in ("", "_std")}}

    curve = [row("inf", 1, 0.1), row(10.0, 693, 0.3), row(1.0, 952, 0.5)]  # "inf" as the json holds it
    table = [{"method": "local-only", "minority_kid": 0.2, "majority_kid": 0.1}]
    plot_eps_curve(curve, table, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_pfdm_cells_average_their_seeds_and_keep_what_is_not_a_number():
    from experiments.pfdm import aggregate

    runs = [{"method": "pfdm", "clients": 4, "epsilon": 10.0, "seed": s, "t0": 693, "wall_seconds": 60.0,
             "run_dir": f"r{s}", "minority_kid": k, "mia_auc": None, "privacy": {"t0": 693}}
            for s, k in ((0, 0.1), (1, 0.3))]
    cell = aggregate(runs)
    assert cell["seeds"] == [0, 1] and cell["epsilon"] == 10.0 and cell["t0"] == 693 and cell["clients"] == 4
    assert abs(cell["minority_kid"] - 0.2) < 1e-12 and abs(cell["minority_kid_seed_std"] - 0.1) < 1e-12
    assert cell["mia_auc"] is None and cell["privacy"] == {"t0": 693} and cell["wall_seconds"] == 120.0
    assert cell["run_dirs"] == ["r0", "r1"]
    later = aggregate([runs[0], {**runs[1], "t0_energy_ratio": 1.5}])  # a figure only the second run has
    assert later["t0_energy_ratio"] == 1.5 and later["t0_energy_ratio_runs"] == 1 and "minority_kid_runs" not in later
