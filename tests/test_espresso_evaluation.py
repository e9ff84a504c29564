"""Espresso's evaluate phase on a sample of the clients (espresso.evaluate-clients): which nodes get the
classifier, what the run reports, and the refusal of a sample smaller than min-clients."""

import json
from pathlib import Path

import pytest

from fedapp import registry
from fedapp.config import parse_run_config
from fedapp.models.prior.tiny import TEST_CONFIG, random_tiny_prior
from fedapp.results import RunDir
from fedapp.server import ServerRun
from fedapp.simulation import ReplyCache, simulate_in_process

FAST = {"espresso.embed-steps": 2, "espresso.steps": 2, "espresso.ratio": 1.0, "espresso.mixup-pairs": 4,
        "espresso.diffusions-per-latent": 1, "espresso.embed-batch": 8, "server-epochs": 1}

pytestmark = pytest.mark.usefixtures("one_thread")


def _strategy(tmp_path, **kw):
    cfg = parse_run_config({"method": "espresso", "min-clients": 2, "out-dir": str(tmp_path), **kw})
    return registry.strategy_class("espresso")(ServerRun(cfg=cfg, out=RunDir(tmp_path / "run")))


def test_the_evaluate_phase_asks_all_a_seeded_sample_or_none_of_the_nodes(tmp_path):
    nodes = list(range(100, 120))
    assert _strategy(tmp_path).evaluation_nodes(nodes) == nodes  # auto: every node
    assert _strategy(tmp_path, **{"espresso.evaluate-clients": 0}).evaluation_nodes(nodes) == []
    assert _strategy(tmp_path, **{"espresso.evaluate-clients": 25}).evaluation_nodes(nodes) == nodes
    picks = {}
    for seed in range(4):
        s = _strategy(tmp_path, seed=seed, **{"espresso.evaluate-clients": 5})
        picked = s.evaluation_nodes(list(reversed(nodes)))  # the order nodes come in does not matter
        assert len(set(picked)) == 5 and set(picked) <= set(nodes) and picked == sorted(picked)
        assert s.evaluation_nodes(nodes) == picked  # drawn from the seed: the same sample again
        picks[seed] = tuple(picked)
    assert len(set(picks.values())) > 1  # another seed, another sample


def test_auto_asks_every_client_up_to_100_and_a_seeded_sample_of_100_beyond(tmp_path):
    from fedapp.protocols.espresso import AUTO_EVALUATE_CLIENTS

    assert AUTO_EVALUATE_CLIENTS == 100
    hundred = list(range(7, 107))
    assert _strategy(tmp_path).evaluation_nodes(hundred) == hundred  # up to 100: every client, as before
    for count in (101, 1000):
        nodes = list(range(50, 50 + count))
        picks = {seed: _strategy(tmp_path, seed=seed).evaluation_nodes(list(reversed(nodes))) for seed in (0, 0, 1)}
        for picked in picks.values():
            assert len(set(picked)) == 100 and set(picked) <= set(nodes) and picked == sorted(picked)
        assert _strategy(tmp_path, seed=0).evaluation_nodes(nodes) == picks[0]  # the same 100 for the same seed
        assert picks[1] != picks[0]  # another seed, another 100
        # the sampled path of espresso.evaluate-clients = 100: the same draw
        assert _strategy(tmp_path, seed=1, **{"espresso.evaluate-clients": 100}).evaluation_nodes(nodes) == picks[1]
    many = list(range(300))  # min-clients above 100: auto's sample keeps min-clients replies possible
    assert len(_strategy(tmp_path, **{"min-clients": 150}).evaluation_nodes(many)) == 150
    from fedapp.plan import make_plan

    plan = make_plan({"method": "espresso", "dataset": "digits", "partitioner.name": "iid", "partitioner.per-class": 0,
                      "min-clients": 2}, 150, bench=False)["comm"]["by_phase"]
    down = {r["phase"]: r["messages"] for r in plan if r["direction"] == "down"}
    assert down["train"] == pytest.approx(150) and down["evaluate"] == pytest.approx(100)  # the plan asks as the run


def test_a_sample_smaller_than_min_clients_is_refused_before_the_run():
    check = registry.preflight_check("espresso")
    cfg = parse_run_config({"method": "espresso", "min-clients": 3, "espresso.evaluate-clients": 2,
                            "espresso.gamma1": 3.0})
    assert check(cfg) == ("espresso.evaluate-clients=2: must be 0, 'auto' or >= min-clients=3 (the evaluate phase "
                          "needs min-clients replies)")
    for ok in (0, 3, "auto"):
        assert check(parse_run_config({"method": "espresso", "min-clients": 3, "espresso.evaluate-clients": ok,
                                       "espresso.gamma1": 3.0})) is None


def test_only_the_sampled_clients_get_the_classifier_and_report_its_accuracy(tmp_path, inside_a_run):
    prior = random_tiny_prior(TEST_CONFIG, dataset="digit-styles", seed=0).save_pretrained(tmp_path / "prior")
    base = {"method": "espresso", "dataset": "digit-styles", "partitioner": "domain", "partitioner.per-class": 2,
            "prior": str(prior), "min-clients": 2, "out-dir": str(tmp_path), **FAST}
    cache = ReplyCache()  # evaluate-clients is the server's: the second run reuses the clients' uploads
    runs = {n: simulate_in_process({**base, "run-name": f"eval{n}", "espresso.evaluate-clients": n}, 4,
                                   reply_cache=cache) for n in (2, 0)}
    for n, summary in runs.items():
        assert summary["status"] == "completed" and summary["failures"] == []
        m = summary["metrics"]
        by_phase = json.loads((Path(summary["run_dir"]) / "comm.json").read_text())["by_phase"]
        evaluated = {c for c, phases in by_phase.items() if phases.get("evaluate", {}).get("messages_down")}
        assert m["evaluated_clients"] == len(evaluated) == n
        assert len(m.get("per_client_accuracy", {})) == n and 0 <= m["accuracy"] <= 1
        assert m.get("evaluated_partitions", []) == sorted(int(p) for p in m.get("per_client_accuracy", {}))
        assert sum(1 for phases in by_phase.values() if phases.get("train", {}).get("messages_down")) == 4
    assert cache.hits >= 4  # the 0-client run's train phase came from the cache
    from fedapp.plan import make_plan

    planned = {n: {(r["phase"], r["direction"]): r for r in make_plan(
        {**base, "espresso.evaluate-clients": n}, 4, bench=False)["comm"]["by_phase"]} for n in ("auto", 2, 0)}
    every = planned["auto"][("evaluate", "down")]
    assert every["messages"] == 4 and every["bytes"] > 4 * 1_000_000  # the classifier to each of 4 clients
    half = planned[2][("evaluate", "down")]
    assert half["messages"] == 2 and half["bytes"] == pytest.approx(every["bytes"] / 2, rel=1e-4)  # the config's
    # record differs by the key's value only
    assert planned[0].get(("evaluate", "down"), {"messages": 0})["messages"] == 0
    by_phase = json.loads((Path(runs[2]["run_dir"]) / "comm.json").read_text())["by_phase"]
    sent = sum(phases["evaluate"]["down"] for phases in by_phase.values() if "evaluate" in phases)
    assert abs(planned[2][("evaluate", "down")]["bytes"] - sent) < 0.01 * sent  # the plan's bytes are the run's


def test_client_accuracy_is_absent_not_zero_when_the_evaluated_clients_hold_no_test_image():
    from fedapp.metrics import weighted_client_accuracy

    empty = weighted_client_accuracy({3: {"accuracy": 0.0, "n": 0}, 7: {"accuracy": 0.0, "n": 0}})
    assert empty["client_accuracy"] is None and set(empty["per_client_accuracy"]) == {"3", "7"}
    mixed = weighted_client_accuracy({3: {"accuracy": 0.5, "n": 2}, 7: {"accuracy": 1.0, "n": 6}})
    assert mixed["client_accuracy"] == pytest.approx(0.875)
