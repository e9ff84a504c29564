"""What every table prints beside its means (experiments.common): convergence verdicts, same-seed
differences, the CPU budget of --jobs/--threads; and how the FedDifRC, PFDM and DCFM tables use them
(compute per row, the PFDM oracle's budget). Synthetic inputs, plus the tables already in docs/results/."""

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from experiments import common
from experiments.common import (all_converged, check_cpu_budget, classification_verdict, generative_verdict,
                                paired_difference, paired_text)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "results"


# ---- verdicts ------------------------------------------------------------------------------------------------
def test_a_flat_curve_is_converged_in_percent_and_in_fractions():
    flat = [50.0] * 10 + [50.4] * 10  # last-5 mean 50.4 at round 20, 50.0 at round 10: +0.4 points
    v = classification_verdict(flat)
    assert v["converged"] and v["delta_points"] == pytest.approx(0.4) and v["rounds"] == 20
    frac = classification_verdict([x / 100 for x in flat])  # the same curve in [0, 1]: the same points
    assert frac["converged"] and frac["delta_points"] == pytest.approx(0.4)


def test_a_rising_curve_is_not_converged():
    rising = [0.10 + 0.01 * r for r in range(20)]  # +1 point a round: +10 points over 10 rounds
    v = classification_verdict(rising)
    assert not v["converged"] and v["delta_points"] == pytest.approx(10.0)
    assert "moved +10.00 points" in v["reason"]
    falling = [60.0] * 10 + [58.9] * 10  # |-1.1| >= 1: a drop is not converged either
    assert not classification_verdict(falling)["converged"]
    edge = [50.0] * 10 + [51.0] * 10  # exactly 1 point: not < 1
    assert not classification_verdict(edge)["converged"]


def test_a_curve_shorter_than_15_rounds_is_too_short():
    v = classification_verdict([0.5] * 14)
    assert v == {"converged": False, "reason": "too short", "rounds": 14}
    assert classification_verdict([0.5] * 15)["converged"]  # 15: rounds 11-15 against rounds 1-5


def test_generative_verdict_needs_90_percent_of_the_oracle_samples():
    assert not generative_verdict(0.89)["converged"]
    assert generative_verdict(0.90)["converged"] and generative_verdict(0.3 * 3)["converged"]  # 0.8999999999999999
    assert generative_verdict(float(torch.tensor([1.0] * 360 + [0.0] * 40).mean()))["converged"]  # float32: 0.89999998
    assert not generative_verdict(359 / 400)["converged"]
    assert "89.0% (< 90%)" in generative_verdict(0.89)["reason"]
    assert generative_verdict(None) == {"converged": False, "reason": "no oracle run"}


def test_a_cell_is_converged_only_if_every_seed_is():
    ok, short = classification_verdict([50.0] * 20), classification_verdict([50.0] * 3)
    both = all_converged([ok, short])
    assert (not both["converged"] and both["reason"] == "too short"
            and (both["seeds"], both["converged_seeds"]) == (2, 1))
    assert all_converged([ok, ok])["converged"] and not all_converged([])["converged"]


# ---- paired seeds --------------------------------------------------------------------------------------------
def test_paired_difference_over_the_shared_seeds():
    a = {0: 50.0, 1: 48.0, 2: 47.0, 3: 99.0}  # seed 3: the baseline lacks it
    b = {"0": 49.0, "1": 49.0, "2": 45.0}  # json keeps seeds as strings
    p = paired_difference(a, b, higher_is_better=True)
    assert p["n"] == 3 and p["mean"] == pytest.approx(2 / 3)  # differences +1, -1, +2
    assert p["std"] == pytest.approx(((1 / 3) ** 2 + (5 / 3) ** 2 + (4 / 3) ** 2) ** 0.5 / 3 ** 0.5)
    assert p["favour"] == 2 and p["per_seed"] == {"0": 1.0, "1": -1.0, "2": 2.0}  # the seeds both have
    lower = paired_difference(a, b, higher_is_better=False)  # a distance: a smaller a wins
    assert lower["mean"] == pytest.approx(2 / 3) and lower["favour"] == 1
    tie = paired_difference({0: 1.0}, {0: 1.0}, higher_is_better=True)
    assert tie["favour"] == 0 and paired_difference({0: 1.0}, {0: 1.0}, higher_is_better=False)["favour"] == 0


def test_paired_difference_skips_missing_figures_and_prints_sign_spread_and_count():
    p = paired_difference({0: 3.0, 1: None, 2: 1.0}, {0: 1.0, 1: 2.0, 2: 2.0}, higher_is_better=True)
    assert (p["n"], p["mean"], p["std"], p["favour"]) == (2, 0.5, 1.5, 1)
    assert paired_text(p) == "+0.5 ± 1.5 (1/2)"
    assert paired_text(paired_difference({0: 1.0}, {0: 2.25}, True), 2) == "-1.25 ± 0.00 (0/1)"
    empty = paired_difference({0: 1.0}, {1: 1.0}, True)
    assert empty == {"mean": None, "std": None, "n": 0, "favour": 0, "per_seed": {}} and paired_text(empty) == "n/a"


# ---- CPU budget ----------------------------------------------------------------------------------------------
def test_jobs_times_threads_must_fit_the_cores():
    check_cpu_budget(2, 1, cpus=2)
    check_cpu_budget(1, 0, cpus=2)  # torch's default on one job: every core, once
    with pytest.raises(SystemExit, match=r"--jobs 3 x --threads 1 = 3 threads > 2 CPU cores"):
        check_cpu_budget(3, 1, cpus=2)
    with pytest.raises(SystemExit, match=r"--jobs 2 x --threads 0 \(torch's default: 4\) = 8 threads > 4 CPU"):
        check_cpu_budget(2, 0, cpus=4)


@pytest.mark.parametrize("name, argv", [("dcfm", ["--threads", "3"]), ("feddifrc", ["--threads", "3"]),
                                        ("dcfm_toy", ["--threads", "3"]), ("espresso_conditions", ["--threads", "3"]),
                                        ("espresso_ablation", ["--jobs", "2", "--threads", "2"]),
                                        ("pfdm_budget", ["--threads", "3"]), ("dcfm_budget", ["--threads", "3"])])
def test_every_runner_with_threads_refuses_to_oversubscribe(monkeypatch, tmp_path, name, argv):
    import importlib

    monkeypatch.setattr(common, "available_cpus", lambda: 2)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="> 2 CPU cores"):
        importlib.import_module(f"experiments.{name}").main([*argv, "--out", str(tmp_path / "out")])
    assert list(tmp_path.iterdir()) == []


# ---- FedDifRC ------------------------------------------------------------------------------------------------
def _row(curve, steps=None):
    return {"curve": curve, **({"steps": steps, "images_seen": 16 * steps} if steps else {})}


def test_feddifrc_table_prints_verdicts_paired_differences_and_compute():
    from experiments.feddifrc import cell_summary, table_text

    flat = [0.40] * 20
    results = {"a0.5": {
        "fedavg": {"0": _row(flat, 100), "1": _row([0.42] * 20, 120), "2": _row([0.44] * 20, 110)},
        # seed 1 still rising (+10 points over the last 10 rounds): the cell is not converged
        "feddifrc": {"0": _row([0.41] * 20, 100), "1": _row([0.30 + 0.01 * r for r in range(20)], 120),
                     "2": _row([0.43] * 20, 110)}}}
    text = table_text(results, ["a0.5"], ["fedavg", "feddifrc"])
    lines = text.splitlines()
    assert lines[2] == "| FedAvg | 42.00 ± 1.63 (n=3) |"
    assert lines[3].startswith("| FedDifRC | ") and lines[3].endswith(" (n=3) not converged |")
    # same seeds: 41 - 40, 47 - 42 (seed 1's last 5 rounds: 45..49, mean 47), 43 - 44
    assert "| FedDifRC | a0.5 | +1.7 ± 2.5 (2/3) | 110 | 1,760 |" in lines
    assert "| FedAvg | a0.5 | — | 110 | 1,760 |" in lines
    c = cell_summary(results, "a0.5", "feddifrc")
    assert c["vs_fedavg"]["favour"] == 2 and c["vs_fedavg"]["mean"] == pytest.approx(5 / 3)
    assert c["vs_fedavg"]["std"] == pytest.approx((56 / 9) ** 0.5) and c["steps"] == 110
    assert c["verdict"]["converged_seeds"] == 2 and not c["verdict"]["converged"]
    assert cell_summary(results, "a0.5", "fedavg")["verdict"]["converged"]


def test_feddifrc_cells_read_the_second_half_median_and_dips_beside_the_last_rounds():
    from experiments.feddifrc import cell_summary

    # FedAvg seed 0 dips in its last rounds; FedDifRC dips often in the second half but not at the end
    fedavg = {"0": _row([0.5] * 10 + [0.95] * 7 + [0.70, 0.96, 0.96]), "1": _row([0.5] * 10 + [0.96] * 10)}
    feddifrc = {"0": _row([0.5] * 10 + [0.85, 0.94] * 4 + [0.95, 0.95]), "1": _row([0.5] * 10 + [0.94] * 10)}
    c = cell_summary({"path": {"fedavg": fedavg, "feddifrc": feddifrc}}, "path", "feddifrc")
    assert c["vs_fedavg"]["per_seed"]["0"] > 0  # the last-5 rule favours FedDifRC on FedAvg's dipped seed ...
    assert c["second_half"]["0"] == {"median": pytest.approx(94.0), "rounds_below": 4}
    assert c["second_half"]["1"] == {"median": pytest.approx(94.0), "rounds_below": 0}
    median = c["second_half_median_vs_fedavg"]  # ... its second half does not: FedAvg's medians are 95 and 96
    assert median["per_seed"] == {"0": pytest.approx(-1.0), "1": pytest.approx(-2.0)} and median["favour"] == 0
    base = cell_summary({"path": {"fedavg": fedavg}}, "path", "fedavg")
    assert base["second_half"]["0"]["rounds_below"] == 1 and "second_half_median_vs_fedavg" not in base


def test_feddifrc_seed_table_shows_each_seed_and_its_paired_difference():
    from experiments.feddifrc import seed_table

    results = {"a0.5": {"fedavg": {"0": _row([0.90] * 20), "1": _row([0.92] * 20), "2": _row([0.94] * 20)},
                        # seed 2 still rising by 10 points over the last 10 rounds: 2 of 3 converged
                        "feddifrc": {"0": _row([0.91] * 20), "1": _row([0.91] * 20),
                                     "2": _row([0.80 + 0.01 * r for r in range(20)])}}}
    lines = seed_table(results, "a0.5", ["fedavg", "feddifrc"], "50 rounds × 10 local epochs").splitlines()
    assert lines[0].startswith("| α = 0.5, 50 rounds × 10 local epochs | last-5 mean (seeds 0 / 1 / 2) |")
    assert lines[2] == "| FedAvg | 92.00 ± 1.63 (90.00 / 92.00 / 94.00) | — | — | 3 of 3 |"
    # same seeds: 91 - 90, 91 - 92, 97 - 94 (seed 2's last 5 rounds: 95..99); second-half medians 91 - 90,
    # 91 - 92, 94.5 - 94
    assert lines[3] == ("| FedDifRC | 93.00 ± 2.83 (91.00 / 91.00 / 97.00) | +1.0 ± 1.6 (2/3); per seed "
                        "+1.00 / -1.00 / +3.00 | +0.2 ± 0.8 (2/3) | 2 of 3 |")
    alone = seed_table({"a0.5": {"feddifrc": results["a0.5"]["feddifrc"]}}, "a0.5", ["fedavg", "feddifrc"], "x")
    assert alone.splitlines()[2].endswith(" | — | — | 2 of 3 |")  # no FedAvg cells: nothing to pair


def test_feddifrc_doc_rewrites_the_pages_block_from_the_json_without_running(tmp_path, monkeypatch):
    import experiments.feddifrc as efd

    monkeypatch.setattr(efd, "run", lambda *a, **k: pytest.fail("--seeds '' runs nothing"))
    argv = ["--out", str(tmp_path), "--rounds", "20", "--local-epochs", "10", "--splits", "a0.05"]
    results = {"a0.05": {"fedavg": {"0": _row([0.5] * 20)}, "feddifrc": {"0": _row([0.6] * 20)}}}
    efd.write_table(tmp_path / "feddifrc_mnist-5k.json", efd.table_setup(efd.parser().parse_args(argv)), results)
    page = tmp_path / "page.md"
    page.write_text("# FedDifRC\n\n<!-- feddifrc:feddifrc_mnist-5k-20x10 -->\nold\n"
                    "<!-- /feddifrc:feddifrc_mnist-5k-20x10 -->\n\nprose after\n")
    efd.main([*argv, "--seeds", "", "--doc", str(page)])
    body = page.read_text()
    assert "old" not in body and body.endswith("prose after\n")
    assert "| FedDifRC | 60.00 ± 0.00 (60.00) | +10.0 ± 0.0 (1/1); per seed +10.00 |" in body
    with pytest.raises(SystemExit, match="no cells measured under this setup"):  # another budget: no cells
        efd.main([*argv[:3], "30", *argv[4:], "--seeds", ""])


def test_feddifrc_ablation_rows_are_also_read_against_the_row_they_flip():
    from experiments.feddifrc import cell_summary, table_text

    results = {"a0.1": {"fedavg": {k: _row([0.90] * 20) for k in "012"},
                        "feddifrc": {k: _row([0.88] * 20) for k in "012"},
                        "feddifrc-t261": {"0": _row([0.91] * 20), "1": _row([0.89] * 20)}}}
    c = cell_summary(results, "a0.1", "feddifrc-t261")
    assert c["vs_feddifrc"]["mean"] == pytest.approx(2.0) and c["vs_feddifrc"]["favour"] == 2
    assert c["vs_fedavg"]["mean"] == pytest.approx(0.0) and "vs_feddifrc" not in cell_summary(results, "a0.1",
                                                                                             "feddifrc")
    text = table_text(results, ["a0.1"], ["feddifrc", "feddifrc-t261"])
    assert "| FedDifRC, t 261 (official code) | a0.1 | -0.0 ± 1.0 (1/2) | FedDifRC: +2.0 ± 1.0 (2/2) |" in text
    assert "| FedDifRC | a0.1 | -2.0 ± 0.0 (0/3) | — |" in text


def test_feddifrc_tables_already_in_docs_still_print(tmp_path):
    from experiments.feddifrc import SPLITS, cells, plot, table_text

    old = json.loads((DOCS / "feddifrc.json").read_text())["results"]  # measured before compute was recorded
    text = table_text(old, [s for s in SPLITS if s in old], ["fedavg", "feddifrc"])
    assert "| FedAvg | a0.05 | — | n/a | n/a |" in text
    results = json.loads((DOCS / "feddifrc_mnist-5k.json").read_text())["results"]  # the table at the budget
    splits = [s for s in SPLITS if s in results]
    c = cells(results, splits, ["fedavg", "feddifrc"])
    assert c["a0.1"]["feddifrc"]["vs_fedavg"]["n"] == 3 and c["a0.1"]["fedavg"]["steps"] > 0
    assert "not converged" in table_text(results, splits, ["fedavg", "feddifrc"])
    plot(results, splits, ["fedavg", "feddifrc"], tmp_path / "rounds.png", "mnist-5k")
    assert (tmp_path / "rounds.png").read_bytes()[:4] == b"\x89PNG"


def test_two_runners_on_one_table_keep_each_others_rows_and_their_own_win(tmp_path):
    from experiments.feddifrc import write_table

    path, setup = tmp_path / "t.json", {"rounds": 20}
    first = {"a0.1": {"fedavg": {"0": _row([0.40] * 20)}}}
    write_table(path, setup, first)
    # a second runner started before the first wrote: it knows only its own cells (and one stale row)
    second = {"a0.1": {"fedavg": {"1": _row([0.50] * 20)}, "feddifrc": {"0": _row([0.45] * 20)}}}
    merged = write_table(path, setup, second)
    on_disk = json.loads(path.read_text())["results"]
    assert on_disk == merged
    assert sorted(on_disk["a0.1"]["fedavg"]) == ["0", "1"] and on_disk["a0.1"]["feddifrc"]["0"]["curve"][0] == 0.45
    write_table(path, setup, {"a0.1": {"fedavg": {"0": _row([0.41] * 20)}}})  # a re-measured row replaces
    assert json.loads(path.read_text())["results"]["a0.1"]["fedavg"]["0"]["curve"][0] == 0.41
    write_table(path, {"rounds": 40}, {"a0.1": {"moon": {"0": _row([0.3] * 20)}}})  # another setup: no merge
    assert list(json.loads(path.read_text())["results"]["a0.1"]) == ["moon"]


@pytest.mark.usefixtures("inside_a_run", "one_torch_thread")
@pytest.mark.parametrize("fraction_evaluate", [0.0, 1.0])
def test_feddifrc_compute_counts_each_train_reply_of_a_real_run(tmp_path, fraction_evaluate):
    import math

    from experiments.feddifrc import run_compute, shard_sizes
    from fedapp.simulation import simulate_in_process

    flat = {"method": "fedavg", "dataset": "digits", "partitioner": "iid", "partitioner.per-class": 3,
            "num-server-rounds": 2, "local-epochs": 2, "batch-size": 8, "min-clients": 3,
            "fraction-evaluate": fraction_evaluate, "out-dir": str(tmp_path), "run-name": "r"}
    summary = simulate_in_process(flat, 3)
    sizes = shard_sizes(flat, 3)
    assert summary["status"] == "completed" and len(sizes) == 3 and min(sizes) > 8
    got = run_compute(flat, summary, sizes)
    # every client trains in both rounds: 2 rounds x 2 epochs x ceil(n_k / 8) steps, 2 x 2 x n_k images
    assert got == {"steps": sum(4 * math.ceil(n / 8) for n in sizes), "images_seen": sum(4 * n for n in sizes)}
    assert run_compute({**flat, "fraction-evaluate": 0.5}, summary, sizes) is None


# ---- PFDM ----------------------------------------------------------------------------------------------------
def test_pfdm_oracle_trains_at_least_as_many_steps_as_any_federated_row():
    from experiments.pfdm import FEDERATED, ORACLE, config, denoiser_compute, oracle_steps, parser

    args = parser().parse_args([])
    assert args.backend == "inprocess"
    totals = {m: denoiser_compute(config(args, m, 0), args.clients)["steps"] for m in FEDERATED}
    # 4 clients x 400 steps: fedavg-ddpm 4 rounds x 100 a client; pfdm's private denoisers + z_w's 400
    assert totals["fedavg-ddpm"] == totals["dpdm"] == totals["local-only"] == 1600 and totals["pfdm"] == 2000
    oracle = config(args, ORACLE, 0)
    assert oracle["pfdm.shared-steps"] == oracle_steps(args) == max(totals.values()) == 2000
    assert denoiser_compute(oracle, args.clients) == {"steps": 2000, "images_seen": 2000 * 64}
    # --set moves the federated rows; the oracle follows, even past a --set of its own steps
    more = parser().parse_args(["--set", "pfdm.local-steps=1000", "pfdm.shared-steps=10"])
    assert config(more, ORACLE, 0)["pfdm.shared-steps"] == 4 * 1000 + 10
    assert config(more, "pfdm", 0)["pfdm.shared-steps"] == 10


def test_pfdm_budget_is_the_first_checkpoint_where_every_seed_reads_90_percent():
    from experiments.pfdm_budget import budget, verdict

    def seed(accs, reader=0.98):
        return {"reader_accuracy": reader, "points": [{"steps": s, "sample_accuracy": a}
                                                      for s, a in zip((500, 1000, 2000), accs)]}

    assert budget({"0": seed([0.5, 0.92, 0.95]), "1": seed([0.6, 0.88, 0.91])}) == {
        "steps": 2000, "guidance": 1.0, "readers_reliable": True}
    assert budget({"0": seed([0.5, 0.92, 0.95]), "1": seed([0.6, 0.88, 0.89], reader=0.96)}) == {
        "steps": None, "guidance": None, "readers_reliable": False}
    # several guidance scales: the first checkpoint where one scale converges on every seed
    both = {str(k): {"reader_accuracy": 0.98, "points": [
        {"steps": 500, "sample_accuracy": 0.8, "sample_accuracy_by_guidance": {"1.0": 0.6, "3.0": 0.8}},
        {"steps": 1000, "sample_accuracy": 0.95, "sample_accuracy_by_guidance": {"1.0": 0.7, "3.0": 0.9 + k / 100}}]}
        for k in range(2)}
    assert budget(both) == {"steps": 1000, "guidance": 3.0, "readers_reliable": True}
    # the verdict reads each seed's last checkpoint (at its best scale): 0.95 on both seeds converges
    assert verdict(both)["converged"] and verdict(both)["seeds"] == 2
    assert not verdict({"0": seed([0.5, 0.92, 0.95]), "1": seed([0.6, 0.95, 0.89])})["converged"]


@pytest.mark.usefixtures("one_torch_thread")
def test_pfdm_budget_sweep_trains_one_run_and_reads_each_checkpoint(tmp_path):
    from experiments.pfdm_budget import main

    main(["--dataset", "colored-digits", "--image-size", "8", "--steps", "3,6", "--samples", "20",
          "--sample-steps", "2", "--ref-epochs", "1", "--seeds", "0", "--batch", "16", "--out", str(tmp_path),
          "--p-uncond", "0.2", "--guidance", "1,3", "--runs-dir", str(tmp_path / "runs")])
    out = json.loads((tmp_path / "pfdm_budget_colored-digits_8px_uncond0.2.json").read_text())
    pts = out["seeds"]["0"]["points"]
    assert [q["steps"] for q in pts] == [3, 6] and out["setup"]["p_uncond"] == 0.2
    assert "device" not in out["setup"]  # where it ran: a sweep moved to a GPU continues the same file
    for q in pts:  # each checkpoint read at both scales; the headline is the better one
        assert set(q["sample_accuracy_by_guidance"]) == {"1.0", "3.0"}
        assert q["sample_accuracy"] == max(q["sample_accuracy_by_guidance"].values())
        # per class at that scale: 20 class-balanced samples of 10 classes, 2 each; their mean is the headline
        assert len(q["sample_accuracy_by_class"]) == 10 and set(q["sample_accuracy_by_class"]) <= {0.0, 0.5, 1.0}
        assert sum(q["sample_accuracy_by_class"]) / 10 == pytest.approx(q["sample_accuracy"])
    counts = out["seeds"]["0"]["train_class_counts"]
    assert len(counts) == 10 and sum(counts) == out["seeds"]["0"]["train_images"]
    assert pts[1]["train_seconds"] >= pts[0]["train_seconds"] > 0  # cumulative: three more steps
    assert 0 < out["seeds"]["0"]["reader_accuracy"] <= 1 and out["budget"]["steps"] is None  # 6 steps learn nothing
    assert out["verdict"]["converged"] is False and out["verdict"]["seeds"] == 1
    assert (tmp_path / "pfdm_budget_colored-digits_8px_uncond0.2.png").stat().st_size > 0


def test_pfdm_budget_device_is_where_it_runs_not_what_it_measures(monkeypatch):
    import torch

    from experiments import pfdm_budget

    with pytest.raises(Exception, match=r"device='gpu': must be auto, cpu, cuda or cuda:N"):
        pfdm_budget.torch_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pfdm_budget.torch_device("auto") == "cpu" and pfdm_budget.torch_device("cuda:1") == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pfdm_budget.torch_device("auto") == "cuda"


@pytest.mark.usefixtures("one_torch_thread")
def test_a_stopped_pfdm_budget_sweep_continues_from_its_last_checkpoint_to_the_uninterrupted_figures(
        tmp_path, monkeypatch):
    """Stopped while reading its step-6 checkpoint, the same command continues from the step-3 training state
    (runs-dir), keeps step 3's reading from the partial entry and ends with the figures of a sweep that was
    never stopped."""
    import strategies.generation_eval as gen
    from experiments.pfdm_budget import main

    def argv(out):
        return ["--dataset", "colored-digits", "--image-size", "8", "--steps", "3,6,9", "--samples", "20",
                "--sample-steps", "2", "--ref-epochs", "1", "--seeds", "0", "--batch", "16", "--out", str(out),
                "--runs-dir", str(out / "runs")]

    def points(out):
        return json.loads((out / "pfdm_budget_colored-digits_8px.json").read_text())

    main(argv(tmp_path / "whole"))
    whole = points(tmp_path / "whole")["seeds"]["0"]
    real, calls = gen.sample_model, []

    def stopped_at_the_second_reading(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(gen, "sample_model", stopped_at_the_second_reading)
    with pytest.raises(KeyboardInterrupt):
        main(argv(tmp_path / "cut"))
    assert [q["steps"] for q in points(tmp_path / "cut")["partial"]["0"]["points"]] == [3]
    monkeypatch.setattr(gen, "sample_model", real)
    main(argv(tmp_path / "cut"))
    resumed = points(tmp_path / "cut")["seeds"]["0"]
    assert resumed["resumed_from_step"] == 3 and [q["steps"] for q in resumed["points"]] == [3, 6, 9]
    for a, b in zip(resumed["points"], whole["points"]):
        assert (a["sample_accuracy"], a["loss"]) == (b["sample_accuracy"], b["loss"]), a["steps"]


@pytest.mark.usefixtures("one_torch_thread")
def test_dcfm_budget_sweep_reads_one_experts_seen_pairs_at_each_checkpoint(tmp_path, monkeypatch):
    import clients.dcfm
    from experiments.dcfm_budget import budget, main, parser, result_path

    trained, real = [], clients.dcfm.train_expert
    monkeypatch.setattr(clients.dcfm, "train_expert", lambda *a, **kw: trained.append(kw) or real(*a, **kw))
    main(["--dataset", "colored-digits", "--image-size", "8", "--steps", "2,4", "--samples-per-pair", "2",
          "--sample-steps", "2", "--ref-epochs", "1", "--width", "8", "--batch", "8", "--train", "client1",
          "--lambda-ci", "1", "--ci-batch", "4", "--out", str(tmp_path)])
    assert [(kw["lambda_ci"], kw["ci_batch"], kw["steps"]) for kw in trained] == [(1.0, 4, 4)]  # the table's L_CI
    out = json.loads((tmp_path / "dcfm_budget_colored-digits_8px_non-iid_client1_w8_ci1.json").read_text())
    s = out["seeds"]["0"]
    assert [q["steps"] for q in s["points"]] == [2, 4] and 0 < s["seen_pairs"] < 60  # a client lacks pairs
    for q in s["points"]:
        assert q["loss_fm"] > 0 and 0 <= q["seen_composition_accuracy"] <= min(q["seen_digit_accuracy"],
                                                                              q["seen_color_accuracy"])
    assert out["verdict"]["converged"] is False and out["budget"]["steps"] is None  # 4 steps learn nothing
    assert (tmp_path / "dcfm_budget_colored-digits_8px_non-iid_client1_w8_ci1.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="--train='client9': must be pooled or client<k>"):
        main(["--train", "client9", "--out", str(tmp_path)])
    # an L_CI expert is its own sweep: it neither resumes nor overwrites the plain L_FM one
    names = {result_path(parser().parse_args(argv)).name for argv in ([], ["--lambda-ci", "1"], ["--lambda-ci", "0.5"])}
    assert names == {"dcfm_budget_colored-mnist_16px_non-iid_pooled.json",
                     "dcfm_budget_colored-mnist_16px_non-iid_pooled_ci1.json",
                     "dcfm_budget_colored-mnist_16px_non-iid_pooled_ci0.5.json"}
    # the budget: the first checkpoint where every seed reads >= 90 %, readers judged by their thresholds
    def seed(accs, digit=0.98, color=0.995):
        return {"reader_accuracy": {"digit": digit, "color": color},
                "points": [{"steps": k, "seen_composition_accuracy": v} for k, v in zip((1, 2, 3), accs)]}
    assert budget({"0": seed([0.5, 0.91, 0.95]), "1": seed([0.6, 0.89, 0.92])}) == {
        "steps": 3, "readers_reliable": True}
    assert budget({"0": seed([0.95] * 3, color=0.98)})["readers_reliable"] is False


def test_the_attacks_positive_control_memorises_by_construction_and_leaves_the_oracle_budget_alone():
    """memorising-ddpm: the oracle method on a few images per class for many steps, no privacy; it is not a
    federated row, so the oracle's budget (the largest federated total) does not grow with it."""
    from experiments.pfdm import CONTROLS, config, denoiser_compute, oracle_steps, parser

    args = parser().parse_args([])
    ctl = config(args, "memorising-ddpm", 0)
    assert ctl["method"] == "centralized-ddpm" and ctl["partitioner.per-class"] == 3
    assert ctl["pfdm.shared-steps"] == 4000 >= 10 * args.steps
    assert denoiser_compute(ctl, args.clients)["steps"] == 4000
    assert oracle_steps(args) == 2000 and set(CONTROLS) == {"memorising-ddpm"}
    fewer = parser().parse_args(["--set", "pfdm.shared-steps=50"])  # --set still has the last word
    assert config(fewer, "memorising-ddpm", 0)["pfdm.shared-steps"] == 50


@pytest.mark.usefixtures("inside_a_run", "one_torch_thread")
def test_pfdm_rows_run_in_process_by_default_and_the_oracle_gets_its_budget(tmp_path):
    from experiments.common import run
    from experiments.pfdm import ORACLE, config, oracle_steps, parser

    args = parser().parse_args(["--steps", "4", "--rounds", "2", "--samples", "30", "--sample-steps", "3",
                                "--attack-samples", "20", "--runs", str(tmp_path),
                                "--set", "pfdm.ref-epochs=1", "pfdm.batch=16"])
    for method in (ORACLE, "pfdm"):
        s = run(config(args, method, 0), args.clients, args.backend)
        assert s["status"] == "completed" and s["failures"] == [], method
        ran = json.loads((Path(s["run_dir"]) / "config.json").read_text())
        assert ran["pfdm.shared-steps"] == (oracle_steps(args) if method == ORACLE else 4)
    assert oracle_steps(args) == 4 * 4 + 4  # pfdm: 4 private denoisers x 4 steps + z_w's 4


def _pfdm_run(method, seed, **figures):
    return {"method": method, "clients": 4, "epsilon": 10.0, "seed": seed, **figures}


def test_pfdm_verdict_from_the_oracle_and_paired_rows_against_local_only_and_the_private_model():
    from experiments.pfdm import paired_rows, print_table, table_verdict

    oracle = [_pfdm_run("centralized-ddpm", s, sample_accuracy=a) for s, a in ((0, 0.95), (1, 0.85))]
    assert not table_verdict(oracle)["converged"] and table_verdict(oracle[:1])["converged"]
    by_cell = {("local-only", 4, 10.0): [_pfdm_run("local-only", s, mean_distance=d, minority_kid=1.0,
                                                   minority_sample_accuracy=0.5) for s, d in ((0, 5.0), (1, 6.0))],
               ("pfdm", 4, 10.0): [_pfdm_run("pfdm", s, mean_distance=d, minority_kid=0.5, private_only_mean_distance=p,
                                             private_only_minority_kid=0.5, minority_sample_accuracy=a,
                                             private_only_minority_sample_accuracy=0.6)
                                   for s, d, p, a in ((0, 4.0, 4.5, 0.7), (1, 7.0, 6.0, 0.4))]}
    rows = {(q["method"], q["against"]): q for q in paired_rows(by_cell, 4, 10.0)}
    vs_local, vs_private = rows["pfdm", "local-only"], rows["pfdm", "its private model alone"]
    assert vs_local["mean_distance"] == {"mean": 0.0, "std": 1.0, "n": 2, "favour": 1,
                                         "per_seed": {"0": -1.0, "1": 1.0}}
    assert vs_local["minority_kid"]["mean"] == -0.5 and vs_local["minority_kid"]["favour"] == 2
    assert vs_private["mean_distance"]["mean"] == pytest.approx(0.25) and vs_private["minority_kid"]["favour"] == 0
    # the minority classes' reading: higher is better, so a seed favours pfdm when it reads more
    assert vs_local["minority_sample_accuracy"]["per_seed"] == pytest.approx({"0": 0.2, "1": -0.1})
    assert vs_local["minority_sample_accuracy"]["favour"] == 1 and vs_private["minority_sample_accuracy"]["favour"] == 1
    table = [{"method": "pfdm", "clients": 4, "seeds": [0, 1], "steps": 2000, "images_seen": 128000}]
    text = print_table(table, table_verdict(oracle), list(rows.values()))
    assert text.startswith("verdict: not converged (centralized-ddpm, 1/2 seeds converged; oracle samples read as "
                           "the requested class 85.0% (< 90%))")
    assert "| 2,000 | 128,000 | not converged |" in text
    assert "| pfdm - local-only | +0.000 ± 1.000 (1/2) | -0.500 ± 0.000 (2/2) | +5.0 ± 15.0 (1/2) |" in text
    assert "| minority_sample_accuracy (points) (higher is better) |" in text


def test_a_pfdm_figure_some_seeds_lack_says_how_many_it_stands_on():
    from experiments.pfdm import aggregate, cell

    rows = [_pfdm_run("centralized-ddpm", s, wall_seconds=1.0, run_dir="x", sample_accuracy=0.9) for s in (0, 1, 2)]
    rows[1]["minority_sample_accuracy"], rows[2]["minority_sample_accuracy"] = 0.8, 0.9
    c = aggregate(rows)
    assert cell(c, "minority_sample_accuracy", True) == "85.0 ± 5.0 (2 of 3 seeds)"
    assert cell(c, "sample_accuracy", True) == "90.0 ± 0.0"
    rows[2].pop("minority_sample_accuracy")
    assert cell(aggregate(rows), "minority_sample_accuracy", True) == "80.0 (1 of 3 seeds)"  # one seed: no std


def test_pfdm_doc_rewrites_the_pages_block_from_the_json_without_running(tmp_path, monkeypatch):
    import experiments.pfdm as ep

    monkeypatch.setattr(ep, "run", lambda *a, **k: pytest.fail("--seeds '' runs nothing"))
    argv = ["--out", str(tmp_path), "--dataset", "colored-mnist", "--image-size", "16", "--steps", "3200",
            "--scaling", "", "--seeds", ""]
    setup = ep.table_setup(ep.parser().parse_args(argv))
    runs = [_pfdm_run("local-only", s, mean_distance=5.0, minority_kid=1.0, minority_sample_accuracy=0.5,
                      wall_seconds=1.0, run_dir="x") for s in (0, 1)]
    runs += [_pfdm_run("pfdm", s, mean_distance=4.0, minority_kid=0.5, minority_sample_accuracy=a,
                       private_only_mean_distance=4.5, private_only_minority_kid=0.5,
                       private_only_minority_sample_accuracy=0.6, wall_seconds=1.0, run_dir="x")
             for s, a in ((0, 0.7), (1, 0.8))]
    (tmp_path / "pfdm_colored-mnist.json").write_text(json.dumps({"setup": setup, "runs": runs}))
    page = tmp_path / "page.md"
    block = "pfdm:pfdm_colored-mnist-16px-3200"
    page.write_text(f"# PFDM\n\n<!-- {block} -->\nold\n<!-- /{block} -->\n\nprose after\n")
    ep.main([*argv, "--doc", str(page)])
    body = page.read_text()
    assert "old" not in body and body.endswith("prose after\n")
    assert "| pfdm (N=4) | 2 | n/a | n/a | 4.000 ± 0.000 | n/a | 0.500 ± 0.000 | n/a | 75.0 ± 5.0 |" in body
    assert "| pfdm - local-only | -1.000 ± 0.000 (2/2) | -0.500 ± 0.000 (2/2) | +25.0 ± 5.0 (2/2) |" in body
    assert "| pfdm - its private model alone | -0.500 ± 0.000 (2/2) | +0.000 ± 0.000 (0/2) | +15.0 ± 5.0 (2/2) |" \
        in body
    with pytest.raises(SystemExit, match="no runs under this setup"):  # another budget: no runs
        ep.main([*argv[:7], "1600", *argv[8:], "--doc", str(page)])


def test_pfdm_table_already_in_docs_still_prints():
    from experiments.pfdm import print_table

    old = json.loads((DOCS / "pfdm.json").read_text())
    text = print_table(old["table"])  # no verdict, no compute: printed as such
    assert "| n/a | n/a | not converged |" in text


# ---- DCFM ----------------------------------------------------------------------------------------------------
def test_a_dcfm_row_keeps_every_rows_figures_and_the_method_specific_ones_it_has():
    from experiments.dcfm import FIGURE_KEYS, row_figures

    every = {k: float(i) for i, k in enumerate(FIGURE_KEYS)}
    ddm = row_figures({**every, "router_holder_weight": 0.4, "router_holder_weight_end": 0.7, "rounds": 3})
    assert ddm == {**every, "router_holder_weight": 0.4, "router_holder_weight_end": 0.7}  # not `rounds`
    assert row_figures(every) == every
    with pytest.raises(KeyError, match="novel_distance"):  # a run without a table figure is no row
        row_figures({k: v for k, v in every.items() if k != "novel_distance"})


def test_dcfm_rows_compute_verdict_per_split_and_paired_rows():
    from experiments.dcfm import SETTINGS, flow_compute, paired_rows, split_verdicts, summarise, table

    settings = {**SETTINGS, "dataset": "colored-digits"}
    c = {n: flow_compute(n, settings, 5)["steps"] for n in ("fedflow", "ddm", "local-only-flow", "dcfm-a", "dcfm-b")}
    # fedflow 5 x 4 rounds x 25; Stage I 5 x 100; + router 100; + 5 x 2 rounds x 30 peer steps; + 200 distill
    assert c == {"fedflow": 500, "ddm": 600, "local-only-flow": 500, "dcfm-a": 800, "dcfm-b": 700}
    assert flow_compute("dcfm-b", settings, 5)["images_seen"] == 700 * 32

    def row(method, split, seed, seen, novel_d, novel_acc):
        return {"method": method, "split": split, "seed": seed, "seen_distance": 1.0, "novel_distance": novel_d,
                "seen_composition_accuracy": seen, "novel_composition_accuracy": novel_acc,
                "model_transfers_per_client": 1.0}

    rows = [row("fedflow", "iid", s, 0.95, 10.0, 0.2) for s in (0, 1)] + [row("fedflow", "non-iid", 0, 0.5, 9.0, 0.1)]
    rows += [row("dcfm-a", "iid", s, 0.9, 8.0 + s, 0.3) for s in (0, 1)]
    v = split_verdicts(rows)
    assert v["iid"]["converged"] and not v["non-iid"]["converged"]
    (q,) = paired_rows(rows)  # dcfm-a against fedflow at iid: the only pair both have
    assert (q["method"], q["against"], q["split"]) == ("dcfm-a", "fedflow", "iid")
    assert q["novel_distance"] == {"mean": -1.5, "std": 0.5, "n": 2, "favour": 2, "per_seed": {"0": -2.0, "1": -1.0}}
    assert (q["novel_composition_accuracy"]["mean"] == pytest.approx(0.1)
            and q["novel_composition_accuracy"]["favour"] == 2)
    text = table(rows, {"fedflow": {"steps": 500, "images_seen": 16000}})
    assert text.splitlines()[2].endswith("500       16,000  converged")
    assert text.splitlines()[4].endswith("  not converged")  # fedflow, non-iid
    big = {**rows[0], "seen_kid": 4019.876, "seen_kid_std": 244.015, "novel_kid": 10552.568, "novel_kid_std": 389.736}
    assert "  4019.876±244.015  10552.568±389.736  " in table([big])  # wide KIDs keep their columns apart
    cells = {(s["method"], s["split"]): s for s in summarise(rows)}
    assert cells["dcfm-a", "iid"]["verdict"]["converged"] and not cells["fedflow", "non-iid"]["verdict"]["converged"]


def test_two_dcfm_table_runners_merge_their_cells_into_one_json(tmp_path):
    """Two runners (seeds 0 and 1, the same settings) each hold an old view of the json: record_row merges under
    the lock, so neither overwrites the other's cells; a cell run again replaces its row; other settings start
    a fresh table."""
    from experiments.dcfm import SETTINGS, record_row

    path, settings = tmp_path / "dcfm_colored-mnist.json", {**SETTINGS, "dataset": "colored-mnist"}

    def row(method, seed, novel_d):
        return {"method": method, "split": "non-iid", "seed": seed, "seen_distance": 1.0, "novel_distance": novel_d,
                "seen_composition_accuracy": 0.95, "novel_composition_accuracy": 0.5,
                "model_transfers_per_client": 1.0}

    record_row(path, row("fedflow", 0, 10.0), settings, 5, {"fedflow": {"steps": 1, "images_seen": 64}})
    record_row(path, row("fedflow", 1, 12.0), settings, 5, {"dcfm-a": {"steps": 2, "images_seen": 128}})
    done = record_row(path, row("dcfm-a", 1, 9.0), settings, 5, {})
    assert json.loads(path.read_text()) == done
    assert sorted((r["method"], r["seed"]) for r in done["rows"]) == [("dcfm-a", 1), ("fedflow", 0), ("fedflow", 1)]
    assert set(done["compute"]) == {"fedflow", "dcfm-a"}  # each runner's compute kept
    (ff,) = [m for m in done["mean_over_seeds"] if m["method"] == "fedflow"]
    assert ff["seeds"] == [0, 1]
    (q,) = done["paired"]  # dcfm-a against fedflow on seed 1, the only seed both have
    assert q["novel_distance"]["per_seed"] == {"1": -3.0}
    done = record_row(path, row("fedflow", 1, 11.0), settings, 5, {})  # the same cell again: replaced
    assert [r["novel_distance"] for r in done["rows"] if r["method"] == "fedflow"] == [10.0, 11.0]
    done = record_row(path, row("fedflow", 0, 5.0), {**settings, "dcfm.width": 8}, 5, {})
    assert [(r["method"], r["seed"]) for r in done["rows"]] == [("fedflow", 0)]


def test_dcfm_markdown_shows_each_run_the_means_over_seeds_and_the_paired_differences(tmp_path):
    """The --doc view: runs in table order (split, row, seed), means ± std in %, a verdict per split, and
    A - FedFlow in FD and in points; a figure a run lacks reads n/a."""
    from experiments.dcfm import SETTINGS, markdown, record_row

    path, settings = tmp_path / "t.json", {**SETTINGS, "dataset": "colored-mnist"}

    def row(method, seed, novel_d, novel_acc):
        return {"method": method, "split": "non-iid", "seed": seed, "seen_distance": 12.0, "novel_distance": novel_d,
                "seen_composition_accuracy": 0.97, "novel_composition_accuracy": novel_acc,
                "novel_digit_accuracy": novel_acc, "model_transfers_per_client": 160.02, "seconds": 1234.4,
                "client_calls_reused": 300 * (method == "fedflow" and seed == 1)}

    for r in (row("dcfm-a", 1, 700.0, 0.3), row("fedflow", 1, 40.0, 0.9), row("fedflow", 0, 60.0, 0.8),
              row("dcfm-a", 0, 600.0, 0.1)):
        done = record_row(path, r, settings, 5, {"fedflow": {"steps": 20000, "images_seen": 1}})
    lines = markdown(done).splitlines()
    runs = [ln for ln in lines if ln.startswith("| non-iid |") and ln.count("|") == 12]
    assert [ln.split(" | ")[1:3] for ln in runs[:4]] == [["fedflow", "0"], ["fedflow", "1"], ["dcfm-a", "0"],
                                                          ["dcfm-a", "1"]]
    assert runs[0] == ("| non-iid | fedflow | 0 | 97.0 | 80.0 | n/a / 80.0 | n/a / n/a | 12 / 60 | n/a "
                       "| 160.0 | 1,234 |")
    assert runs[1].endswith("| 1,234 (300 client calls cached) |")
    (ff,) = [ln for ln in lines if ln.startswith("| non-iid | fedflow | 0,1 |")]
    assert "| 85.0 ± 5.0 |" in ff and "| 50 ± 10 |" in ff and "| 20,000 |" in ff and ff.endswith("| converged |")
    (q,) = [ln for ln in lines if "dcfm-a − fedflow" in ln]
    assert q == "| non-iid | dcfm-a − fedflow | +600 ± 60 (0/2) | -65.0 ± 5.0 (0/2) |"


def test_dcfm_copies_each_methods_first_non_iid_grid_beside_the_json(tmp_path):
    from experiments.dcfm import copy_grids

    rows = []
    runs = (("fedflow", 1, "non-iid"), ("fedflow", 0, "non-iid"), ("fedflow", 0, "iid"), ("dcfm-b", 0, "non-iid"),
            ("ddm", 0, "non-iid"), ("dcfm-b@dcfm.rounds=1", 0, "non-iid"))
    for method, seed, split in runs:
        run = tmp_path / "runs" / f"{method}-{split}-{seed}"
        (run / "images").mkdir(parents=True)
        (run / "images" / "grid.png").write_bytes(f"{method} {split} {seed}".encode())
        rows.append({"method": method, "seed": seed, "split": split, "run_dir": str(run)})
    shutil.rmtree(tmp_path / "runs" / "ddm-non-iid-0")  # a run folder gone (another machine): skipped
    copied = copy_grids(rows, tmp_path, "dcfm_colored-mnist")
    assert sorted(p.name for p in copied) == ["dcfm_colored-mnist_grid.png", "dcfm_colored-mnist_grid_dcfm-b.png",
                                              "dcfm_colored-mnist_grid_fedflow.png"]
    assert (tmp_path / "dcfm_colored-mnist_grid_fedflow.png").read_bytes() == b"fedflow non-iid 0"  # the first seed
    assert (tmp_path / "dcfm_colored-mnist_grid.png").read_bytes() == b"dcfm-b non-iid 0"


def test_a_dcfm_sweep_runs_each_row_once_per_value_into_its_own_json_sharing_stage_one(tmp_path):
    """--sweep KEY=V1,V2: rows "<row>@KEY=<value>" (the value typed as --set types it), their compute from
    their own settings, written to <stem>_sweep_<key>.json; the second value reuses the first's Stage I."""
    from experiments import dcfm

    assert dcfm.sweep_rows([("dcfm-b", {"dcfm.variant": "b"})], "dcfm.distill-steps=5,10") == [
        ("dcfm-b@dcfm.distill-steps=5", {"dcfm.variant": "b", "dcfm.distill-steps": 5}),
        ("dcfm-b@dcfm.distill-steps=10", {"dcfm.variant": "b", "dcfm.distill-steps": 10})]
    with pytest.raises(SystemExit, match=r"--sweep='dcfm.distill-steps': must be KEY=V1,V2"):
        dcfm.sweep_rows([("dcfm-b", {})], "dcfm.distill-steps")
    with pytest.raises(SystemExit, match="--rows=dcfm-c: must be among fedflow,ddm"):
        dcfm.main(["--rows", "dcfm-c", "--quick"])
    dcfm.main(["--quick", "--rows", "dcfm-b", "--splits", "non-iid", "--sweep", "dcfm.distill-steps=5,10",
               "--threads", "1", "--out", str(tmp_path), "--runs", str(tmp_path / "runs")])
    out = json.loads((tmp_path / "dcfm_sweep_dcfm.distill-steps.json").read_text())
    assert [(r["method"], r["split"]) for r in out["rows"]] == [("dcfm-b@dcfm.distill-steps=5", "non-iid"),
                                                                 ("dcfm-b@dcfm.distill-steps=10", "non-iid")]
    assert [r["client_calls_reused"] for r in out["rows"]] == [0, 5]  # 5 clients' Stage I, trained once
    c = out["compute"]
    assert c["dcfm-b@dcfm.distill-steps=10"]["steps"] - c["dcfm-b@dcfm.distill-steps=5"]["steps"] == 5
    assert [m["method"] for m in out["mean_over_seeds"]] == [r["method"] for r in out["rows"]]
    assert not (tmp_path / "dcfm.json").exists()  # the table's json is not touched


def test_dcfm_table_already_in_docs_still_prints():
    from experiments.dcfm import paired_rows, summarise, table

    rows = json.loads((DOCS / "dcfm.json").read_text())["rows"]  # one seed, written before `seed` was a key
    assert "not converged" in table(rows) and len(summarise(rows)) == len(rows)
    assert {(q["method"], q["against"]) for q in paired_rows(rows)} == {
        ("dcfm-a", "fedflow"), ("dcfm-a", "ddm"), ("dcfm-b", "fedflow"), ("dcfm-b", "ddm")}


def test_parsers_default_to_the_in_process_backend():
    from experiments import dcfm

    a = dcfm.parser().parse_args([])
    assert a.backend == "inprocess" and a.threads == common.available_cpus()
    assert isinstance(a, argparse.Namespace)


def test_espresso_ablation_pairs_the_papers_steps_on_shared_seeds():
    from experiments.espresso_ablation import paired_steps

    def seed(**acc):
        return {"results": {k.replace("_", "-").replace("plus", "+"): {"mean_domain_accuracy": v}
                            for k, v in acc.items()}}

    per_seed = {"0": seed(Prompts_only=0.70, C=0.72, CplusG=0.75, CplusGplusZ=0.74, class_embed=0.73),
                "1": seed(Prompts_only=0.70, C=0.69, CplusG=0.73, CplusGplusZ=0.74, class_embed=0.71),
                "2": seed(Prompts_only=0.70, C=0.71)}  # a seed without the later rows pairs only where it can
    p = paired_steps(per_seed)
    assert p["C - Prompts-only"]["n"] == 3 and p["C - Prompts-only"]["favour"] == 2
    assert p["C - Prompts-only"]["mean"] == pytest.approx((2 - 1 + 1) / 3)
    assert p["C+G - C"]["n"] == 2 and p["C+G - C"]["mean"] == pytest.approx(3.5) and p["C+G - C"]["favour"] == 2
    assert p["C+G+Z - C+G"]["mean"] == pytest.approx(0.0) and p["C+G+Z - class-embed"]["favour"] == 2
    assert p["C+G+Z - Prompts-only"]["per_seed"] == pytest.approx({"0": 4.0, "1": 4.0})


def test_a_sweep_keeps_a_stopped_seeds_checkpoints_apart_and_a_finished_seed_replaces_them(tmp_path):
    from experiments.common import run_sweep

    path, setup = tmp_path / "sweep.json", {"steps": "1,2"}

    def summarise(seeds):
        return {"n": len(seeds)}

    def stopped(seed, progress, partial):
        assert partial == []
        progress([{"steps": 1, "acc": 0.5}])
        raise KeyboardInterrupt  # the run is stopped after its first checkpoint

    with pytest.raises(KeyboardInterrupt):
        run_sweep(path, setup, "0", stopped, summarise)
    on_disk = json.loads(path.read_text())
    assert on_disk["partial"] == {"0": {"points": [{"steps": 1, "acc": 0.5}]}} and on_disk["seeds"] == {}

    def whole(seed, progress, partial):
        assert partial == [{"steps": 1, "acc": 0.5}]  # handed back, for a run that can continue
        points = [{"steps": 1, "acc": 0.6}]
        progress(points)
        return {"points": points + [{"steps": 2, "acc": 0.7}]}

    out = run_sweep(path, setup, "0", whole, summarise)  # this measure measures the seed again, whole
    on_disk = json.loads(path.read_text())
    assert "partial" not in on_disk and on_disk["seeds"]["0"]["points"][-1]["acc"] == 0.7 and on_disk["n"] == 1
    assert out["seeds"] == on_disk["seeds"]


def test_leaderboard_pareto_front_keeps_exactly_the_points_nothing_dominates():
    from experiments.leaderboard import pareto_front

    pts = {"cheap": (1.0, 80.0), "dear": (100.0, 97.0), "worse": (50.0, 79.0), "tie": (1.0, 80.0), "mid": (10.0, 90.0)}
    assert pareto_front(pts) == ["cheap", "tie", "mid", "dear"]  # "worse" costs more than cheap for less
    assert pareto_front({"a": (2.0, 1.0), "b": (2.0, 2.0)}) == ["b"]


@pytest.mark.parametrize("partitioner", ["domain", "dirichlet"])
def test_leaderboard_round_cells_train_their_fraction_of_the_clients_and_pass_preflight(partitioner):
    """min-clients is Flower's floor on a round's sample: a round-based cell sets it to the round's share,
    so fraction-train applies (the first Dirichlet cells set it to all 10 and trained 10 of 10 a round)."""
    from experiments.leaderboard import ENTRIES, SETTINGS, cell_config, parser, round_based
    from fedapp.config import all_defaults, parse_run_config
    from fedapp.preflight import check_sample_size

    clients = SETTINGS[partitioner]["clients"]
    a = parser().parse_args(["--partitioner", partitioner])
    for entry in ENTRIES:
        flat = cell_config(a, entry, 0)
        cfg = parse_run_config({**all_defaults(), **flat})
        check_sample_size(cfg, clients)
        trained = max(int(clients * cfg.fraction_train), cfg.min_clients)  # Flower FedAvg's sample size
        expected = int(clients * SETTINGS[partitioner]["rounds"].get("fraction-train", 1.0))
        assert trained == (expected if round_based(flat["method"]) else clients), entry
    assert expected == {"domain": 4, "dirichlet": 5}[partitioner]
    a = parser().parse_args(["--partitioner", partitioner, "--set", "min-clients=2"])
    assert cell_config(a, "FedAvg", 0)["min-clients"] == 2  # an explicit override stays


def test_leaderboard_settings_sharing_one_runs_folder_run_in_folders_of_their_own():
    """The two documented settings take the same --runs: a cell of one must never meet the other's run folder
    (ensure_run refuses a folder that holds another run config); the folder moves no cell's digest."""
    from experiments.leaderboard import cell_config, cell_file, parser

    styles = parser().parse_args(["--dataset", "mnist-styles", "--partitioner", "domain", "--runs", "r"])
    mnist = parser().parse_args(["--dataset", "mnist-5k", "--partitioner", "dirichlet", "--alpha", "0.1",
                                 "--runs", "r"])
    a, b = cell_config(styles, "FedAvg", 0), cell_config(mnist, "FedAvg", 0)
    assert a["run-name"] == b["run-name"] == "fedavg-s0"
    assert Path(a["out-dir"]).parent == Path(b["out-dir"]).parent == Path("r")
    assert a["out-dir"] != b["out-dir"]
    assert cell_file(Path("c"), a) == cell_file(Path("c"), {**a, "out-dir": "elsewhere"})


def test_leaderboard_cell_figures_leave_the_final_evaluation_out_of_the_methods_cost():
    from experiments import leaderboard
    from experiments.leaderboard import figures, summarise

    summary = {"num_clients": 2, "wall_seconds": 10.0,
               "metrics": {"accuracy": 0.9, "per_client_accuracy": {"0": 0.8, "1": 1.0}},
               "comm": {"up_bytes": 1000, "down_bytes": 3000, "compute_seconds": 6.0}}
    comm = {"by_phase": {"11": {"train": {"up": 400, "down": 1000, "seconds": 2.0},
                                "evaluate": {"up": 50, "down": 500, "seconds": 0.5}},
                         "12": {"train": {"up": 450, "down": 1000, "seconds": 3.0},
                                "evaluate": {"up": 100, "down": 500, "seconds": 0.5}}}}
    f = figures(summary, comm, curve=None)
    assert f["prior_bytes_per_client"] == 0
    # a prior shipped in this run (its nodes did not hold it yet) is a one-off, reported beside the method's bytes
    shipped = {"by_phase": {**comm["by_phase"], "13": {"query.prior": {"up": 8, "down": 700, "seconds": 0.0}}}}
    assert leaderboard.ships_prior(shipped) and not leaderboard.ships_prior(comm)
    g = figures({**summary, "comm": {**summary["comm"], "down_bytes": 3700, "up_bytes": 1008}}, shipped, None, 900)
    assert (g["down_bytes_per_client"], g["up_bytes_per_client"], g["prior_bytes_per_client"]) == (1000, 425, 900)
    assert f["up_bytes_per_client"] == 425 and f["down_bytes_per_client"] == 1000  # (1000 - 150) / 2, (3000 - 1000) / 2
    assert f["client_seconds_per_client"] == 2.5 and f["server_seconds"] == 4.0 and f["rounds"] == 1
    assert f["accuracy"] == pytest.approx(90.0) and f["client_accuracy_std"] == pytest.approx(10.0)
    oracle = figures({**summary, "metrics": {**summary["metrics"], "oracle": True}}, comm, None)
    assert oracle["rounds"] == 0
    rows = summarise({"FedAvg": {"0": f, "1": {**f, "accuracy": 80.0}}, "X": {"0": {**f, "accuracy": 95.0}}})
    assert rows["X"]["vs_baseline"]["per_seed"] == pytest.approx({"0": 5.0}) and "vs_baseline" not in rows["FedAvg"]
    assert rows["FedAvg"]["accuracy"]["mean"] == pytest.approx(85.0)


def test_leaderboard_serialises_a_built_in_prior_once_a_run_and_a_hub_prior_never(monkeypatch):
    import fedapp.models.prior as prior_pkg
    import torch
    from flwr.app import ArrayRecord, ConfigRecord

    from experiments import leaderboard

    calls = []

    def to_records(location):
        calls.append(location)
        return ArrayRecord({"w": torch.zeros(1000)}), ConfigRecord({"f": "x"})

    monkeypatch.setattr(prior_pkg, "prior_to_records", to_records)
    leaderboard._prior_record_bytes.cache_clear()
    cell = {"prior": "tiny", "dataset": "digits"}
    first = leaderboard.prior_record_bytes(cell)
    assert first >= 4000 and leaderboard.prior_record_bytes({**cell, "method": "prompts"}) == first
    assert len(calls) == 1  # the second cell with that prior read the size, not the weights
    assert leaderboard.prior_record_bytes({"prior": "someone/some-model", "dataset": "digits"}) == 0
    assert len(calls) == 1
    leaderboard._prior_record_bytes.cache_clear()


def test_a_generated_block_replaces_only_itself_in_its_page(tmp_path):
    from experiments.common import write_block

    doc = tmp_path / "leaderboard.md"
    doc.write_text("# Leaderboard\n\nprose stays\n")
    write_block(doc, "leaderboard:a", "table A v1")
    write_block(doc, "leaderboard:b", "table B")
    write_block(doc, "leaderboard:a", "table A v2")
    text = doc.read_text()
    assert "prose stays" in text and "table A v1" not in text and text.index("table A v2") < text.index("table B")


@pytest.mark.usefixtures("one_torch_thread")
def test_leaderboard_runs_each_cell_once_and_a_second_call_only_reads_them(tmp_path, monkeypatch):
    import json

    from experiments import leaderboard

    args = ["--dataset", "digit-styles", "--partitioner", "domain", "--seeds", "0", "--entries", "FedAvg,Centralised",
            "--out", str(tmp_path / "out"), "--doc", str(tmp_path / "leaderboard.md"), "--runs", str(tmp_path / "runs"),
            "--set", "partitioner.per-class=2", "num-server-rounds=2", "local-epochs=1", "server-epochs=1"]
    real_run = leaderboard.run_cell

    def cut_at_the_oracle(flat, clients):
        if flat["method"] == "centralized":
            raise KeyboardInterrupt  # the session's end, mid-table
        return real_run(flat, clients)

    monkeypatch.setattr(leaderboard, "run_cell", cut_at_the_oracle)
    with pytest.raises(KeyboardInterrupt):
        leaderboard.main(args)
    assert "| FedAvg ◆ ⧗ | 1 |" in (tmp_path / "leaderboard.md").read_text()  # on the page as soon as it finished
    monkeypatch.setattr(leaderboard, "run_cell", real_run)
    leaderboard.main(args)
    table = json.loads((tmp_path / "out" / "leaderboard_digit-styles-domain.json").read_text())
    fedavg, oracle = table["cells"]["FedAvg"]["0"], table["cells"]["Centralised"]["0"]
    model_bytes = fedavg["down_bytes_per_client"] / 2  # two rounds of the model down, the final evaluation's left out
    assert fedavg["rounds"] == 2 and fedavg["up_bytes_per_client"] == pytest.approx(2 * model_bytes, rel=0.01)
    assert len(fedavg["per_client_accuracy"]) == 4 and fedavg["client_seconds_per_client"] > 0  # asked once, at the end
    assert oracle["rounds"] == 0 and oracle["up_bytes_per_client"] == 0
    assert table["pareto"]["up_bytes_per_client"] == ["FedAvg"]  # the oracle is a reference, never on the front
    assert table["baseline"] == "FedAvg" and table["summary"]["Centralised"]["vs_baseline"]["n"] == 1
    assert (tmp_path / "out" / "leaderboard_digit-styles-domain.png").is_file()
    page = (tmp_path / "leaderboard.md").read_text()
    assert "| FedAvg ◆ ⧗ | 1 |" in page and "--out" not in page and "--set partitioner.per-class=2" in page
    monkeypatch.setattr(leaderboard, "run_cell", lambda *a: pytest.fail("a cell on disk ran again"))
    leaderboard.main(args)
    cell = next((tmp_path / "out" / "cells").glob("fedavg-*.json"))
    stale = json.loads(cell.read_text())
    cell.write_text(json.dumps({**stale, "figures": {**stale["figures"], "accuracy": -1.0}}))
    leaderboard.main([*args, "--refigure"])  # read again from the run's folder, not run again
    assert json.loads(cell.read_text())["figures"] == fedavg

    tried = []

    def broken(flat, clients):
        tried.append(flat["run-name"])
        raise RuntimeError("node gone")

    monkeypatch.setattr(leaderboard, "run_cell", broken)
    leaderboard.main([*args[:5], "0,1", *args[6:], "--no-run"])  # the cells on disk only: nothing runs, none fails
    assert json.loads((tmp_path / "out" / "leaderboard_digit-styles-domain.json").read_text())["failed_cells"] == {}
    # new seeds' cells fail: reported, the rest still written; a seed's entries run before the next seed's
    leaderboard.main([*args[:5], "0,1,2", *args[6:]])
    assert tried == ["fedavg-s1", "centralised-s1", "fedavg-s2", "centralised-s2"]
    table = json.loads((tmp_path / "out" / "leaderboard_digit-styles-domain.json").read_text())
    assert table["failed_cells"] == {f"{e}, seed {s}": "RuntimeError: node gone" for s in (1, 2)
                                     for e in ("FedAvg", "Centralised")}
    assert table["summary"]["FedAvg"]["seeds"] == ["0"]
    # running one entry publishes the setting's whole table, the rows it did not run included
    leaderboard.main([*args[:7], "Centralised", *args[8:], "--no-run"])
    table = json.loads((tmp_path / "out" / "leaderboard_digit-styles-domain.json").read_text())
    assert list(table["summary"]) == ["FedAvg", "Centralised"]
    assert "--entries" not in (tmp_path / "leaderboard.md").read_text()
    # a table of the oracle alone (its first cell on a new setting) still plots: no point on the log axes
    alone = leaderboard.summarise({"Centralised": {"0": oracle}})
    leaderboard.plot(alone, leaderboard.fronts(alone), tmp_path / "oracle.png", "oracle only")
    assert (tmp_path / "oracle.png").stat().st_size > 0


def _curve(readings, losses, step=2000):
    return [{"steps": step * (i + 1), "sample_accuracy": a, "loss": loss}
            for i, (a, loss) in enumerate(zip(readings, losses))]


def test_a_plateau_is_a_flat_reading_and_loss_over_the_last_4000_steps():
    from experiments.common import budget_verdict, plateau

    # the 16 px oracle's recipe as measured: 88.75 / 89.5 / 89.0 % at 12k / 14k / 16k, loss 0.01398 -> 0.01387
    flat = _curve([0.26, 0.65, 0.805, 0.865, 0.8675, 0.8875, 0.895, 0.89],
                  [0.0206, 0.0183, 0.0159, 0.0154, 0.0145, 0.01398, 0.0136, 0.01387])
    p = plateau(flat)
    assert p["plateau"] and p["from_steps"] == 12000 and p["to_steps"] == 16000
    assert abs(p["move"] - 0.0075) < 1e-9 and abs(p["level"] - (0.8875 + 0.895 + 0.89) / 3) < 1e-9
    v = budget_verdict(flat)
    assert v["converged"] and "89.0% (< 90%)" in v["reason"] and "(plateau)" in v["reason"]
    rising = _curve([0.5, 0.6, 0.7, 0.86, 0.875, 0.888], [0.02, 0.018, 0.017, 0.016, 0.015, 0.0149])
    assert not plateau(rising)["plateau"] and not budget_verdict(rising)["converged"]  # 2.8 points in 4,000 steps
    loss_falls = _curve([0.88, 0.885, 0.884], [0.02, 0.018, 0.016])
    assert not plateau(loss_falls)["plateau"]  # reading flat, loss still 20 % down
    assert not plateau(_curve([0.88, 0.885], [0.014, 0.014]))["plateau"]  # 2,000 steps: too short to tell
    assert budget_verdict(_curve([0.2, 0.95], [0.02, 0.01]))["converged"]  # >= 90 % needs no plateau


def test_the_pfdm_table_counts_an_oracle_on_its_recipes_plateau():
    from experiments.common import plateau
    from experiments.pfdm import table_verdict

    plateaus = [plateau(_curve([0.8, 0.8875, 0.895, 0.89], [0.015, 0.01398, 0.0136, 0.01387], step=2000))]
    assert plateaus[0]["plateau"] and plateaus[0]["from_steps"] == 4000
    on = {"sample_accuracy": 0.885, "steps": 16000}
    assert not table_verdict([on])["converged"]  # without the curve: the 90 % mark
    assert table_verdict([on], plateaus)["converged"]
    assert not table_verdict([{"sample_accuracy": 0.85, "steps": 16000}], plateaus)["converged"]  # below it
    assert not table_verdict([{"sample_accuracy": 0.885, "steps": 2000}], plateaus)["converged"]  # short of it
    v = table_verdict([on, {"sample_accuracy": 0.91, "steps": 16000}], plateaus)
    assert v["converged"] and v["converged_seeds"] == 2


def test_the_pfdm_tables_oracle_rows_carry_their_steps_to_the_plateau_rule():
    from experiments.common import plateau
    from experiments.pfdm import ORACLE, oracle_runs, parser, table_verdict

    readings, losses = [0.2, 0.6, 0.8, 0.85, 0.87, 0.8875, 0.895, 0.89], [0.05, 0.03, 0.02, 0.017, 0.015, 0.01398,
                                                                            0.0136, 0.01387]
    plateaus = [plateau(_curve(readings, losses))]  # every 2,000 steps to 16,000: the plateau from 12,000
    assert plateaus[0]["plateau"] and plateaus[0]["from_steps"] == 12000
    row = {"method": ORACLE, "clients": 4, "epsilon": 10.0, "seed": 0, "sample_accuracy": 0.8999}  # as run_one keeps it
    for steps, on in ((3200, True), (1600, False)):  # the oracle trains clients x steps + steps: 16,000 or 8,000
        args = parser().parse_args(["--steps", str(steps), "--epsilon", "10"])
        runs = oracle_runs(args, {(ORACLE, 4, 10.0): [row]}, 10.0)
        assert runs[0]["steps"] == 5 * steps and runs[0]["seed"] == 0
        assert table_verdict(runs, plateaus)["converged"] is on
    assert not table_verdict([row], plateaus)["converged"]  # the row alone has no steps: only the 90 % mark
