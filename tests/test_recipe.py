"""experiments/recipe.py: the issue's bars computed from stored curves, and the tables it prints."""

from experiments.recipe import FACTORS, STEPS, checks, table_text


def results(a05_round3: float, chance_late: bool) -> dict:
    fed = {"mnist-5k iid/cnn": {"0": [0.6, 0.8, 0.9, 0.93, 0.96], "1": [0.5, 0.7, 0.9, 0.95, 0.94]},
           "mnist-5k iid/cnn-gap": {"0": [0.1, 0.3, 0.5, 0.6, 0.9], "1": [0.1, 0.2, 0.4, 0.6, 0.8]},
           "mnist-5k a0.5/cnn": {"0": [0.4, 0.6, a05_round3, 0.9], "1": [0.3, 0.5, 0.7, 0.1 if chance_late else 0.9]}}
    return {"centralised": {"mnist-5k": {"0": [0.9, 0.985], "1": [0.9, 0.979]}}, "federated": fed,
            "diagnosis": {"all": {"0": {f: [0.1] * len(STEPS) for f in FACTORS}}}}


def test_checks_read_the_bars_from_the_curves():
    ok = checks(results(0.8, chance_late=False))
    assert ok["centralised_final_min"] == 0.979 and ok["centralised_ge_98"] is False
    assert ok["fedavg_iid_best_within_10_rounds_min"] == 0.95 and ok["fedavg_iid_ge_95_within_10_rounds"] is True
    assert ok["fedavg_a05_round3_min"] == 0.7 and ok["fedavg_a05_round3_gt_50"] is True
    assert ok["no_seed_at_chance_after_round_2"] is True
    bad = checks(results(0.5, chance_late=True))
    assert bad["fedavg_a05_round3_gt_50"] is False and bad["no_seed_at_chance_after_round_2"] is False
    assert checks({})["centralised_ge_98"] is None  # a part not run is not a pass


def test_table_has_every_factor_and_the_paired_difference_against_the_old_model():
    text = table_text(results(0.8, chance_late=False))
    assert all(f"| {f} |" in text for f in FACTORS)
    # last round: cnn 0.96 / 0.94 against cnn-gap 0.9 / 0.8 -> +6 and +14 points, both seeds favour the recipe
    assert ("| mnist-5k iid | cnn | 55.0 ± 5.0 | 75.0 ± 5.0 | 90.0 ± 0.0 | 95.0 ± 1.0 | 95.0 ± 1.0 "
            "| +10.0 ± 4.0 (2/2) |") in text
    assert "| mnist-5k, no shift |" not in text and "| mnist-5k | 2 | 98.2 ± 0.3 | 98.2 ± 0.3 |" in text


def test_feddifrc_budget_is_the_cheapest_setting_converged_on_every_seed():
    """experiments/feddifrc_budget.py: a setting converges at the first round R where every seed's last-5 mean
    moved < 1 point since R - 10; the budget is the cheapest converged setting in client epochs."""
    from experiments.feddifrc_budget import converged_at, summary

    flat = [0.9] * 30
    rising = [0.5 + 0.01 * r for r in range(20)]  # +1 point a round: never converged
    late = [0.5 + 0.02 * min(r, 10) for r in range(30)]  # flat from round 11; within 1 point from R = 24
    assert converged_at([flat, flat]) == 15 and converged_at([rising]) is None
    assert converged_at([late]) == 24 and converged_at([flat, late]) == 24
    s = summary({"2": {"0": late, "1": late}, "5": {"0": flat, "1": flat}, "1": {"0": rising}})
    e1, e2, e5 = (s["by_local_epochs"][k] for k in ("1", "2", "5"))
    assert e1["converged_at_round"] is None and e1["client_epochs"] is None
    assert e2["client_epochs"] == 2 * 24 and e5["client_epochs"] == 5 * 15
    assert s["budget"] == {"local_epochs": 2, "rounds": 24}  # 48 client epochs against 75


def test_recipe_json_carries_verdicts_and_same_seed_differences():
    from experiments.recipe import paired, verdicts

    res = results(0.8, chance_late=False)
    v = verdicts(res)
    iid = v["federated"]["mnist-5k iid/cnn"]
    assert iid["reason"] == "too short" and not iid["converged"]
    p = paired(res)
    # round 3: cnn 0.9 / 0.9 against cnn-gap 0.5 / 0.4 -> +40 and +50 points
    assert p["mnist-5k iid: cnn - cnn-gap"]["round_3"] == {"mean": 45.0, "std": 5.0, "n": 2, "favour": 2,
                                                           "per_seed": {"0": 40.0, "1": 50.0}}
    assert "mnist-5k a0.5: cnn - cnn-gap" not in p  # no cnn-gap runs to pair with
    assert "centralised: shift - no shift" not in p  # only the shifted runs


def test_feddifrc_budget_pairs_each_setting_with_the_fewest_local_epochs():
    from experiments.feddifrc_budget import summary

    s = summary({"2": {"0": [0.9] * 20, "1": [0.8] * 20}, "5": {"0": [0.95] * 20, "1": [0.78] * 20}})
    assert "last_round_vs_2_local_epochs" not in s["by_local_epochs"]["2"]
    vs = s["by_local_epochs"]["5"]["last_round_vs_2_local_epochs"]
    assert vs["n"] == 2 and vs["favour"] == 1 and abs(vs["mean"] - 1.5) < 1e-9


def test_feddifrc_budget_measures_another_split_under_its_own_name():
    from experiments.feddifrc_budget import config, stem

    c = config(2, 80, 1, "runs", "a0.1")
    assert c["partitioner.alpha"] == 0.1 and c["num-server-rounds"] == 80 and c["run-name"] == "fedavg-a0.1-e2-r80-s1"
    assert config(2, 40, 0, "runs")["partitioner.alpha"] == 0.5
    assert stem("a0.5") == "feddifrc_budget" and stem("a0.1") == "feddifrc_budget_a0.1"
