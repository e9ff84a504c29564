"""End-to-end simulations: Ray through the public Python API `fedapp.simulate`, and the in-process grid
where the backend is not what a test is about."""

import json
from pathlib import Path

import pytest

import fedapp


def _cfg(tmp_path, **kw):
    base = {"dataset": "digits", "partitioner": "iid", "partitioner.per-class": 0, "num-server-rounds": 2,
            "local-epochs": 1, "out-dir": str(tmp_path), "min-clients": 2}
    base.update(kw)
    return base


# fedprox through the in-process grid: the same server and run folder, without a second Ray start (~15 s)
@pytest.mark.parametrize("method", ["fedavg", "fedprox"])
def test_dirichlet_simulation_writes_a_complete_run_folder(tmp_path, method):
    from fedapp.simulation import simulate_in_process

    simulate = fedapp.simulate if method == "fedavg" else simulate_in_process
    s = simulate(_cfg(tmp_path, method=method, partitioner="dirichlet", **{"partitioner.alpha": 0.1}), num_clients=8)
    assert s["status"] == "completed" and s["method"] == method and s["num_clients"] == 8
    assert 0.0 < s["metrics"]["accuracy"] <= 1.0
    assert set(s["metrics"]["per_client_accuracy"]) == {str(i) for i in range(8)}
    run = Path(s["run_dir"])
    for name in ("config.json", "metrics.jsonl", "summary.json", "comm.json", "plots/accuracy.png"):
        assert (run / name).exists(), name
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [0, 1, 2]
    assert lines[-1]["accuracy"] == s["metrics"]["accuracy"]  # summary = last round's global test
    # Every client downloads the model twice per round (train + evaluate) and uploads it once.
    per = s["comm"]["per_client"]["0"]
    assert per["messages_down"] == 4 and per["up_bytes"] > 0
    # every client reports its own compute time; the run's total is their sum
    seconds = [c["compute_seconds"] for c in s["comm"]["per_client"].values()]
    assert min(seconds) > 0 and s["comm"]["compute_seconds"] == pytest.approx(sum(seconds))
    assert json.loads((run / "config.json").read_text())["method"] == method
    assert s["failures"] == []


def test_fedavg_iid_digits_reaches_90_percent_in_5_rounds(tmp_path, one_torch_thread):
    # The bar for the default FedAvg settings (3 local epochs, lr 0.02, batch 16); in-process, as
    # learning does not depend on the backend (Ray's start-up and two actors' imports: 60 s against 24 s in CI).
    from fedapp.simulation import simulate_in_process

    s = simulate_in_process({"method": "fedavg", "dataset": "digits", "partitioner": "iid",
                             "partitioner.per-class": 0, "num-server-rounds": 5, "out-dir": str(tmp_path),
                             "min-clients": 4}, num_clients=4)
    assert s["metrics"]["accuracy"] >= 0.90
    assert s["metrics"]["client_accuracy"] >= 0.85


def test_a_client_that_raises_is_recorded_and_the_run_completes(tmp_path):
    def explode_on_partition_1(msg, context, call_next):
        if int(context.node_config["partition-id"]) == 1 and msg.metadata.message_type == "train":
            raise RuntimeError("disk on fire")
        return call_next(msg, context)

    s = fedapp.simulate(_cfg(tmp_path, method="fedavg", **{"num-server-rounds": 1}), num_clients=3,
                        client_mods=[explode_on_partition_1])
    assert s["status"] == "completed"
    assert len(s["failures"]) == 1 and s["failures"][0]["phase"] == "train"
    assert "disk on fire" in s["failures"][0]["reason"]
    assert s["metrics"]["accuracy"] > 0.1


def test_ray_resolves_localhost_to_loopback_not_the_routable_address():
    from fedapp.simulation import _keep_ray_on_loopback

    _keep_ray_on_loopback()
    from ray._private import services

    assert services.resolve_ip_for_localhost("127.0.0.1") in ("127.0.0.1", "::1")
