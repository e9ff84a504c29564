"""benchmarks/soak.py at a small size: clients that raise or answer after the round's timeout never stop a run,
every round's model is the weighted mean of exactly its valid replies, the server records every fault, the
memory verdict's slope, and a run killed (SIGKILL) in the middle of a round resumes to the model of a run never
stopped, for every resumable method."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak  # noqa: E402

SMALL = {"min-clients": 2, "fraction-evaluate": 0.5, "evaluate-every": 5, "partitioner.per-class": 1}


@pytest.fixture(autouse=True)
def quiet_one_thread():
    """One torch thread (the machine's cores are shared); the injected faults' warning lines are not the test's."""
    import logging

    from fedapp.progress import setup_logging

    setup_logging()
    log, n = logging.getLogger("fedapp"), torch.get_num_threads()
    level = log.level
    log.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
    log.setLevel(level)


def test_a_faulty_federation_aggregates_the_valid_replies_of_every_round(tmp_path):
    plan = soak.FaultPlan(fail_rate=0.1, late_rate=0.1, seed=0)
    r = soak.run_soak(10, 20, plan, tmp_path, fraction_train=1.0, flat_mib=1e9, extra=SMALL)
    assert r["status"] == "completed" and r["error"] is None and r["passed"], r["checks"]
    train = [row for row in r["rows"] if row["phase"] == "train"]
    assert [row["round"] for row in train] == list(range(1, 11))
    for row in train:
        assert row["asked"] == 20 and row["valid"] == 20 - row["raise"] - row["late"]
        assert row["mean_max_abs_diff"] <= soak.MEAN_TOL and row["server_recorded"]
    evaluate = [row for row in r["rows"] if row["phase"] == "evaluate"]
    assert [row["round"] for row in evaluate] == [5, 10] and all(row["server_recorded"] for row in evaluate)
    f = r["faults"]
    assert f["raised"] > 0 and f["late"] > 0 and f["server_failure_records"] == f["raised"] + f["late"]
    assert f["train_rounds_with_a_fault"] >= 8  # 20 % of 20 clients: a round without a fault is rare
    assert 0.1 < (f["raised"] + f["late"]) / f["messages"] < 0.3
    assert len([row["rss_mib"] for row in train]) == 10 and all(row["rss_mib"] > 0 for row in train)


def test_a_round_left_with_fewer_valid_replies_than_min_clients_is_a_verdict_not_a_crash(tmp_path):
    r = soak.run_soak(2, 20, soak.FaultPlan(0.1, 0.1, 0), tmp_path, fraction_train=1.0, flat_mib=1e9,
                      extra={**SMALL, "min-clients": 20, "fraction-evaluate": 1.0})
    assert r["status"] == "failed" and "fewer than min-clients=20" in r["error"]
    assert not r["passed"] and not r["checks"]["completed"] and not r["checks"]["every_round_trained"]
    assert r["memory"]["slope_last_half_mib_per_100_rounds"] is None and not r["memory"]["flat"]  # one round: no trend


def _reply(w: float, n: int) -> RecordDict:
    return RecordDict({"arrays": ArrayRecord({"w": torch.full((3,), w)}),
                       "metrics": MetricRecord({"num-examples": n})})


def test_the_mean_check_tells_the_valid_set_from_one_reply_more_or_less():
    replies = [_reply(1.0, 1), _reply(2.0, 3), _reply(4.0, 4)]
    every = soak.WeightedMean()
    for rep in replies:
        every.add(rep)
    model = {"w": np.full(3, (1 * 1 + 2 * 3 + 4 * 4) / 8, np.float32)}
    assert every.count == 3 and every.max_abs_diff(model) < 1e-6
    less = soak.WeightedMean()
    for rep in replies[1:]:
        less.add(rep)
    assert less.max_abs_diff(model) > 0.1
    assert every.max_abs_diff({"v": model["w"]}) == float("inf")  # another model's keys
    assert soak.WeightedMean().max_abs_diff(model) == float("inf")  # nothing aggregated


def test_the_fault_plan_is_seeded_has_its_rates_and_refuses_rates_outside_0_1():
    plan = soak.FaultPlan(0.1, 0.2, seed=3)
    fates = [plan.fate("train", r, p) for r in range(1, 51) for p in range(100)]
    assert fates == [soak.FaultPlan(0.1, 0.2, seed=3).fate("train", r, p) for r in range(1, 51) for p in range(100)]
    assert fates != [soak.FaultPlan(0.1, 0.2, seed=4).fate("train", r, p) for r in range(1, 51) for p in range(100)]
    assert abs(fates.count(soak.RAISE) / len(fates) - 0.1) < 0.02
    assert abs(fates.count(soak.LATE) / len(fates) - 0.2) < 0.02
    assert {soak.FaultPlan(0.0, 0.0).fate("train", 1, p) for p in range(100)} == {soak.OK}
    for bad, match in (({"fail_rate": 1.5}, r"^fail-rate=1.5: must be a number in \[0, 1\]$"),
                       ({"late_rate": -0.1}, r"^late-rate=-0.1: must be a number in \[0, 1\]$"),
                       ({"fail_rate": True}, r"^fail-rate=True"),
                       ({"fail_rate": 0.6, "late_rate": 0.6}, r"^fail-rate \+ late-rate=1.2: must be at most 1$")):
        with pytest.raises(ValueError, match=match):
            soak.FaultPlan(**bad)


def test_the_cli_refuses_a_rate_outside_0_1_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        soak.main(["--fail-rate", "2", "--out", "unused"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["soak.py: fail-rate=2.0: must be a number in [0, 1]"]


def test_the_server_records_check_wants_each_faulty_node_once_with_its_reason():
    rows = [{"phase": "train", "round": 1, soak.RAISE: [1001], soak.LATE: [1003]},
            {"phase": "train", "round": 2, soak.RAISE: [], soak.LATE: [1002]}]

    def fail(node, reason):
        return {"node_id": node, "phase": "train", "reason": reason}

    right = [fail(1003, "no reply within 30.0 s"), fail(1001, "client error: InjectedFault: x"),
             fail(1002, "no reply within 30.0 s")]
    for failures, want in ((right, [True, True]),
                           (right[:2], [True, False]),  # round 2's record missing
                           ([right[1], fail(1003, "client error: y"), right[2]], [False, True]),  # wrong reason
                           ([*right, fail(1004, "client error: z")], [False, False])):  # a record no fault explains
        fresh = [dict(r) for r in rows]
        soak.server_records(fresh, failures)
        assert [r["server_recorded"] for r in fresh] == want


@pytest.mark.parametrize(("rounds", "values", "slope"), [
    (range(10), [100.0] * 10, 0.0),
    (range(0, 200, 2), [50 + 0.2 * r for r in range(0, 200, 2)], 20.0),  # 0.2 MiB a round
    (range(5), [1.0, 2.0, 3.0, 4.0, 5.0], 100.0),
])
def test_the_slope_is_per_100_rounds(rounds, values, slope):
    assert soak.slope_per_100(list(rounds), values) == pytest.approx(slope, abs=1e-9)


def test_memory_flat_reads_the_last_half_only():
    rng = np.random.default_rng(0)
    rounds = list(range(1, 201))
    warm_then_flat = [600 + min(r, 20) * 5 + rng.normal(0, 0.5) for r in rounds]  # +100 MiB warm-up, then noise
    verdict = soak.memory_verdict(rounds, warm_then_flat, flat_mib=2.0)
    assert verdict["flat"] and abs(verdict["slope_last_half_mib_per_100_rounds"]) < 2.0
    assert (verdict["rss_start_mib"], verdict["rss_end_mib"]) == (round(warm_then_flat[0], 1),
                                                                   round(warm_then_flat[-1], 1))
    leak = [v + 0.05 * r for v, r in zip(warm_then_flat, rounds)]  # 5 MiB per 100 rounds on top
    verdict = soak.memory_verdict(rounds, leak, flat_mib=2.0)
    assert not verdict["flat"] and verdict["slope_last_half_mib_per_100_rounds"] == pytest.approx(5.0, abs=0.5)
    with pytest.raises(ValueError, match="at least 2 points"):
        soak.slope_per_100([1], [1.0])


@pytest.fixture(scope="module")
def prior_dir(tmp_path_factory):
    return soak.random_prior(tmp_path_factory.mktemp("prior"))


@pytest.mark.parametrize("method", soak.resumable_methods())
def test_a_run_killed_mid_round_resumes_to_the_model_of_a_run_never_stopped(method, tmp_path, prior_dir):
    r = soak.resume_check(method, tmp_path, soak.FaultPlan(0.1, 0.1, seed=0), clients=4, kill_round=2,
                          prior_dir=prior_dir)
    assert r["exit_code"] == -signal.SIGKILL and r["status_after_kill"] == "running"  # killed, nothing written after
    assert r["checkpoint_round"] == 1 and r["resumed_after_round"] == 1 and r["status"] == "completed"
    assert r["final_model_max_abs_diff"] <= soak.RESUME_TOL and r["passed"]
