"""A bad config is one line naming the key, the value and what is allowed, raised before Ray or any
client starts: through `fedapp.simulate` (Ray never starts) and through the ServerApp's `run_server`
(no message is ever sent)."""

from __future__ import annotations

import json
import logging
import time

import pytest
from flwr.clientapp import ClientApp

import fedapp
from fedapp.config import ConfigError, all_defaults, parse_run_config
from fedapp.server_app import run_server

FILE = "__a_file__"  # replaced by a path to an existing file

CASES = [
    ({"method": "nope"}, "method='nope': must be one of"),
    ({"lr": -0.1}, "lr=-0.1: must be > 0"),
    ({"lr": float("inf")}, "lr=inf: must be a finite number"),
    ({"lr": float("nan")}, "lr=nan: must be a finite number"),
    ({"num-server-rounds": 0}, "num-server-rounds=0: must be >= 1"),
    ({"num-server-rounds": "3"}, "num-server-rounds='3': must be of type int"),
    ({"local-epochs": 0}, "local-epochs=0: must be >= 1"),
    ({"batch-size": 0}, "batch-size=0: must be >= 1"),
    ({"seed": -1}, "seed=-1: must be >= 0"),
    ({"image-size": 4}, "image-size=4: must be 'auto' or in [8, 1024]"),
    ({"min-clients": 0}, "min-clients=0: must be >= 1"),
    ({"device": "tpu"}, "device='tpu': must be auto, cpu, cuda or cuda:N"),
    ({"device": "cuda:x"}, "device='cuda:x': must be auto, cpu, cuda or cuda:N"),
    ({"round-timeout": 0.0}, "round-timeout=0.0: must be > 0"),
    ({"node-timeout": -1.0}, "node-timeout=-1.0: must be > 0"),
    ({"max-upload-mb": 0.0}, "max-upload-mb=0.0: must be > 0"),
    ({"server-epochs": 0}, "server-epochs=0: must be >= 1"),
    ({"run-name": "../../x"}, "run-name='../../x': must be a plain folder name"),
    ({"run-name": "a/b"}, "run-name='a/b': must be a plain folder name"),
    ({"bogus-key": 1}, "bogus-key=1: unknown key"),
    ({"log.tensorboard": "yes"}, "log.tensorboard='yes': must be of type bool"),
    ({"log.bogus": 1}, "log.bogus=1: unknown key; allowed: log.tensorboard"),
    ({"partitioner.name": "nope"}, "partitioner.name='nope': must be one of"),
    ({"partitioner.name": "dirichlet", "partitioner.alpha": -1.0}, "partitioner.alpha"),
    ({"partitioner.bogus": 1}, "partitioner.bogus=1: unknown key"),
    ({"fedprox.mu": -1.0}, "fedprox.mu=-1.0: must be >= 0"),
    ({"fedprox.nu": 1.0}, "fedprox.nu=1.0: unknown key"),
    ({"moon.tau": 0.0}, "moon.tau=0.0: must be > 0"),
    ({"feddifrc.up-blocks": "a,b"}, "feddifrc.up-blocks='a,b': must be '' or comma-separated"),
    ({"feddifrc.pca-fit": "x"}, "feddifrc.pca-fit='x': must be one of 'public', 'client'"),
    ({"feddifrc.t": 1000}, "feddifrc.t=1000: must be in [0, 999]"),
    ({"feddifrc.ndcr-form": "l1"}, "feddifrc.ndcr-form='l1': must be one of 'kl', 'normalized-l2', 'l2'"),
    ({"fraction-train": 1.5}, "fraction-train=1.5: must be in (0, 1]"),
    ({"method": "espresso", "fraction-train": 0.5}, "fraction-train=0.5: method='espresso' trains every client"),
    ({"espresso.conditions": "x"}, "espresso.conditions='x': must be one of"),
    ({"espresso.gamma2": 5.0}, "espresso.gamma2=5.0: must be < espresso.gamma1"),
    ({"espresso.steps": 0}, "espresso.steps=0: must be in [1, 1000]"),
    ({"espresso.ship-prior": "x"}, "espresso.ship-prior='x': must be one of"),
    ({"espresso.zigzag": "x"}, "espresso.zigzag='x': must be one of 'paper', 'official'"),
    ({"espresso.spacing": "x"}, "espresso.spacing='x': must be one of 'leading', 'trailing'"),
    ({"prior": "tiny@fresco"}, "prior='tiny@fresco': domains 'fresco': allowed one or more of photo, sketch"),
    ({"pfdm.channels": "abc"}, "pfdm.channels='abc': must be comma-separated positive integers"),
    ({"pfdm.delta": 0.9}, "pfdm.delta=0.9: must be in (0, 0.5]"),
    ({"pfdm.accountant": "x"}, "pfdm.accountant='x': must be one of 'bound', 'rdp', 'pld'"),
    ({"pfdm.epsilon": 0.0}, "pfdm.epsilon=0.0: must be > 0"),
    ({"dcfm.variant": "c"}, "dcfm.variant='c': must be one of 'a', 'b'"),
    ({"dcfm.pi-full": 0.0, "dcfm.pi-marg": 0.0, "dcfm.pi-uncond": 0.0}, "dcfm.pi-full + dcfm.pi-marg"),
    ({"method": "dcfm", "dcfm.pi-full": 0.9},
     "dcfm.pi-full + dcfm.pi-marg + dcfm.pi-uncond = 0.9 (0.9 + 0 + 0): must sum to 1"),
    ({"method": "dcfm", "dcfm.pi-full": 0.5, "dcfm.pi-marg": 0.5, "dcfm.pi-uncond": 0.5}, "= 1.5 (0.5 + 0.5 + 0.5)"),
    ({"dcfm.route-mask": "yes"}, "dcfm.route-mask='yes': must be of type bool"),
    ({"out-dir": FILE}, "out-dir='FILE': is a file; must be a folder"),
    ({"out-dir": FILE + "/sub"}, "out-dir='FILE/sub': not writable"),
    ({"method": "espresso", "prior": "/nonexistent/prior"}, "prior='/nonexistent/prior': no such folder"),
    ({"method": "feddifrc", "prior": "not a hub id"}, "prior='not a hub id': no such folder and not a known name"),
    ({"method": "espresso", "prior": "fedapp-tests/no-such-pipeline"},
     "prior='fedapp-tests/no-such-pipeline': not in the local Hugging Face cache"),
    ({"model": "/nonexistent/resnet"}, "model='/nonexistent/resnet': no such folder and not a hub id"),
    ({"model": "fedapp-tests/no-such-resnet"},
     "model='fedapp-tests/no-such-resnet': not in the local Hugging Face cache"),
    ({"dataset": "digits", "partitioner.name": "domain"},
     "partitioner='domain': dataset digits has no domain attribute"),
    ({"dataset": "fedapp-tests/no-such-dataset"},
     "dataset='fedapp-tests/no-such-dataset': not in the local Hugging Face cache and HF_HUB_OFFLINE is set"),
]


def _resolve(flat: dict, needle: str, tmp_path) -> tuple[dict, str]:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    flat = {k: (str(a_file) + v[len(FILE):] if isinstance(v, str) and v.startswith(FILE) else v)
            for k, v in flat.items()}
    return {"out-dir": str(tmp_path / "runs"), **flat}, needle.replace("FILE", str(a_file))


def _one_line(err: pytest.ExceptionInfo, needle: str) -> None:
    msg = str(err.value)
    assert needle in msg and "\n" not in msg, msg


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_table_has_at_least_forty_bad_values():
    assert len(CASES) >= 40


@pytest.mark.parametrize("flat, needle", CASES)
def test_simulate_refuses_before_ray_starts(flat, needle, tmp_path, monkeypatch):
    import flwr.simulation

    def ray_started(**_):
        raise AssertionError("Ray started before the config was checked")

    monkeypatch.setattr(flwr.simulation, "run_simulation", ray_started)
    flat, needle = _resolve(flat, needle, tmp_path)
    with pytest.raises(ConfigError) as err:
        fedapp.simulate(flat, num_clients=2)
    _one_line(err, needle)


class _NoClientWork:
    """A grid with four connected nodes that fails the test if any message is sent."""

    def get_node_ids(self):
        return [1, 2, 3, 4]

    def send_and_receive(self, messages, timeout=None):
        raise AssertionError("a message was sent before the config was checked")


@pytest.mark.parametrize("flat, needle", CASES)
def test_server_app_refuses_before_any_message(flat, needle, tmp_path):
    from fedapp.config import all_defaults

    flat, needle = _resolve(flat, needle, tmp_path)
    with pytest.raises(ConfigError) as err:
        run_server(_NoClientWork(), {**all_defaults(), **flat})
    _one_line(err, needle)


def test_min_clients_above_the_federation_is_refused_before_ray(tmp_path, monkeypatch):
    import flwr.simulation

    monkeypatch.setattr(flwr.simulation, "run_simulation", lambda **_: pytest.fail("Ray started"))
    with pytest.raises(ConfigError, match=r"^min-clients=5: must be <= the federation's 4 nodes$"):
        fedapp.simulate({"min-clients": 5, "out-dir": str(tmp_path)}, num_clients=4)


def test_a_fraction_that_samples_fewer_than_min_clients_is_refused_before_ray(tmp_path, monkeypatch):
    """Flower's FedAvg samples max(int(nodes x fraction), min-clients): a share under min-clients would be
    replaced silently (fraction-train 0.5 with min-clients = every node trains every node)."""
    import flwr.simulation

    monkeypatch.setattr(flwr.simulation, "run_simulation", lambda **_: pytest.fail("Ray started"))
    with pytest.raises(ConfigError, match=r"^fraction-train=0.5: samples int\(10 x 0.5\) = 5 of the federation's 10 "
                                          r"nodes, fewer than min-clients=10, .*must be >= 10/10, or lower min-clients "
                                          r"to <= 5$"):
        fedapp.simulate({"method": "fedavg", "fraction-train": 0.5, "min-clients": 10, "out-dir": str(tmp_path)},
                        num_clients=10)
    with pytest.raises(ConfigError, match=r"^fraction-evaluate=0.2: samples int\(4 x 0.2\) = 0 .*must be >= 2/4$"):
        fedapp.simulate({"method": "fedavg", "fraction-evaluate": 0.2, "out-dir": str(tmp_path)}, num_clients=4)


@pytest.mark.usefixtures("inside_a_run")
def test_a_deployed_server_warns_where_the_connected_nodes_make_a_fraction_inapplicable(fedapp_log, tmp_path):
    """A deployment's federation may still grow after min-clients nodes connect: the server says so in
    its log, naming the keys, and goes on (here to the first message, which this grid refuses)."""
    from fedapp.config import all_defaults

    flat = {**all_defaults(), "method": "fedavg", "fraction-train": 0.5, "min-clients": 4, "out-dir": str(tmp_path)}
    with pytest.raises(AssertionError, match="a message was sent"):
        run_server(_NoClientWork(), flat)
    warned = [r.getMessage() for r in fedapp_log.records if r.levelname == "WARNING"]
    assert any(m.startswith("fraction-train=0.5: samples int(4 x 0.5) = 2 of the federation's 4 nodes, fewer than "
                            "min-clients=4") and m.endswith("(on the 4 nodes connected at the start)") for m in warned)


def test_node_waiting_is_bounded_by_node_timeout(tmp_path):
    from fedapp.config import all_defaults

    flat = {**all_defaults(), "min-clients": 5, "node-timeout": 0.5, "out-dir": str(tmp_path), "run-name": "r"}
    with pytest.raises(RuntimeError, match=r"min-clients=5: only 4 nodes connected within node-timeout=0.5 s"):
        run_server(_NoClientWork(), flat)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and "node-timeout=0.5 s" in summary["error"]


def test_waiting_for_nodes_says_how_many_are_connected_until_it_gives_up(caplog):
    from fedapp.server import wait_for_nodes

    class Three:
        def get_node_ids(self):
            return [1, 2, 3]

    with caplog.at_level(logging.INFO, logger="fedapp"), pytest.raises(RuntimeError, match="only 3 nodes"):
        wait_for_nodes(Three(), 5, timeout=0.35, poll=0.01, report=0.1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for 5 nodes")]
    assert 2 <= len(lines) <= 4 and all(": 3 connected (" in m and "node-timeout=0.35 s" in m for m in lines)


@pytest.mark.parametrize("flat, key", [({"method": "feddifrc", "prior": "fedapp-tests/no-such-pipeline"}, "prior"),
                                       ({"model": "fedapp-tests/no-such-resnet"}, "model"),
                                       ({"dataset": "fedapp-tests/no-such-dataset"}, "dataset")])
def test_an_uncached_hub_id_on_an_offline_machine_fails_in_one_line_within_two_seconds(flat, key, tmp_path,
                                                                                        monkeypatch):
    from fedapp import preflight as pf

    monkeypatch.delenv("HF_HUB_OFFLINE")  # not told it is offline: the hub is merely unreachable
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing answers
    flat, _ = _resolve(flat, "", tmp_path)
    t0 = time.time()
    with pytest.raises(ConfigError) as err:
        pf.preflight(parse_run_config({**all_defaults(), **flat}))
    assert time.time() - t0 < 2.0
    _one_line(err, f"{key}='{flat[key]}': not in the local Hugging Face cache and the hub is unreachable")


def test_an_uncached_hub_id_is_left_to_download_when_the_hub_answers(monkeypatch):
    from fedapp import preflight as pf

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(pf, "hub_reachable", lambda timeout=1.5: True)
    assert pf.hub_missing("fedapp-tests/no-such-resnet", "config.json") is None
    monkeypatch.setattr(pf, "hub_reachable", lambda timeout=1.5: False)
    assert "unreachable" in pf.hub_missing("fedapp-tests/no-such-resnet", "config.json")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "HF_HUB_OFFLINE" in pf.hub_missing("fedapp-tests/no-such-resnet", "config.json")


def test_an_uncached_hub_dataset_is_refused_offline_before_feddata_loads_it(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE or an unreachable hub: one line at once, where `datasets` would retry the hub for ~25 s
    (five `Retrying in Ns` lines) before its own error. A cached dataset, a built-in or a folder is not asked."""
    import feddata.hub
    from fedapp import preflight as pf

    def loads(*_, **__):
        raise AssertionError("feddata loaded the dataset before preflight refused it")

    monkeypatch.setattr(feddata.hub, "load_hf", loads)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(pf, "hub_reachable", lambda timeout=1.5: False)
    with pytest.raises(ConfigError) as err:
        fedapp.simulate({"dataset": "cifar10", "out-dir": str(tmp_path)}, num_clients=2)  # an alias: its hub id
    _one_line(err, "dataset='cifar10': not in the local Hugging Face cache and the hub is unreachable")
    monkeypatch.setattr(pf, "hub_reachable", lambda timeout=1.5: True)  # the hub answers: left to `datasets`
    pf.check_dataset(parse_run_config({**all_defaults(), "dataset": "fedapp-tests/no-such-dataset"}))


def test_a_hub_dataset_counts_as_cached_in_either_hugging_face_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from feddata.hub import hub_dataset_cached, hub_dataset_id

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    assert not hub_dataset_cached("Owner/MyData")
    (tmp_path / "datasets" / "Owner___my_data").mkdir(parents=True)  # datasets' prepared copy (snake-cased)
    assert hub_dataset_cached("Owner/MyData")
    assert not hub_dataset_cached("owner/other")
    (tmp_path / "hub" / "datasets--owner--other" / "snapshots").mkdir(parents=True)  # the hub's files
    assert hub_dataset_cached("owner/other")
    assert [hub_dataset_id(d) for d in ("digits", "cifar10", "o/n", str(tmp_path), "./x", "a/b/c", "no id")] == [
        None, "uoft-cs/cifar10", "o/n", None, None, None, None]


# ---- a Flower simulation knows its nodes ------------------------------------------------------------------
def _flower_simulation(server_app, flat: dict, num_supernodes: int, monkeypatch, register_after: float = 0.3):
    """`server_app` in Flower's own simulation runtime, as `flwr run`'s flwr-simulation runs it
    (flwr.simulation.run_simulation._run_simulation: the ServerApp on its own thread, an InMemoryGrid, the
    SuperNodes registered by the main thread), with the Ray backend replaced by a stand-in: it registers the
    nodes `register_after` seconds late (the ServerApp may start before them in Flower too) and then only waits
    to be stopped. No Ray, no client."""
    import importlib

    from flwr.app import Context, RecordDict
    from flwr.server.superlink.fleet import vce
    from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
    from flwr.supercore.telemetry import EventType

    rs = importlib.import_module("flwr.simulation.run_simulation")

    def no_ray(*, num_supernodes, state_factory, f_stop, **_):
        time.sleep(register_after)
        _register_nodes(num_nodes=num_supernodes, state_factory=state_factory)
        f_stop.wait(60)

    monkeypatch.setattr(vce, "start_vce", no_ray)
    monkeypatch.setenv("RAY_DEDUP_LOGS", "1")  # the ServerApp would switch it off in this process
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config=flat)
    return rs._run_simulation(num_supernodes=num_supernodes, exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
                              server_app=server_app, client_app=ClientApp(), server_app_context=context)


def test_the_server_reads_a_simulations_node_count_before_its_nodes_register(monkeypatch):
    from flwr.serverapp import ServerApp

    from fedapp.server import simulated_nodes

    seen = {}
    app = ServerApp()

    @app.main()
    def _main(grid, context):
        seen["count"], seen["registered"] = simulated_nodes(grid), len(list(grid.get_node_ids()))

    _flower_simulation(app, {}, 7, monkeypatch)
    assert seen == {"count": 7, "registered": 0}
    assert simulated_nodes(_NoClientWork()) is None  # a deployment's grid: its nodes join over time


SIMULATION_REFUSALS = [  # (config, num-supernodes): what no node that could still join would change
    ({"min-clients": 5}, 4),
    ({}, 0),
    ({"method": "fedavg", "fraction-train": 0.5, "min-clients": 10}, 10),
    ({"method": "fedavg", "fraction-evaluate": 0.2}, 4),
]


@pytest.mark.parametrize("flat, nodes", SIMULATION_REFUSALS)
def test_flwr_runs_simulation_refuses_what_its_nodes_cannot_serve_at_once_with_simulates_line(
        flat, nodes, tmp_path, monkeypatch, fedapp_log):
    """`flwr run` on a simulation: refused at once (node-timeout is 600 s), no run folder, the same line as
    `fedapp.simulate`'s, and that line is the last the ServerApp logs (Flower's traceback follows it)."""
    import flwr.simulation

    from fedapp.server_app import app

    # short timeouts: a server that waited for nodes or replies instead would fail here in seconds
    flat = {**all_defaults(), **flat, "out-dir": str(tmp_path / "runs"), "node-timeout": 5.0, "round-timeout": 5.0}
    monkeypatch.setattr(flwr.simulation, "run_simulation", lambda **_: pytest.fail("Ray started"))
    with pytest.raises(ConfigError) as simulated:
        fedapp.simulate(flat, num_clients=nodes)
    t0 = time.time()
    with pytest.raises(ConfigError) as err:
        _flower_simulation(app, flat, nodes, monkeypatch)
    assert time.time() - t0 < 30 and str(err.value) == str(simulated.value) and "\n" not in str(err.value)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    last = [r for r in fedapp_log.records if r.name == "fedapp"][-1]
    assert (last.levelname, last.getMessage()) == ("ERROR", str(err.value))


@pytest.mark.usefixtures("inside_a_run")
def test_a_refusal_once_the_run_folder_exists_is_the_servers_last_line_and_the_summarys_error(
        tmp_path, monkeypatch, fedapp_log):
    """A deployment learns its nodes only as they join: the data check and the node wait run after the run
    folder exists. Either refusal: summary.json says failed with the line, and the line is logged last."""
    from flwr.app import Context, RecordDict

    from fedapp.server_app import main

    monkeypatch.setenv("RAY_DEDUP_LOGS", "1")
    for flat, line in (({"dataset": "digits", "partitioner.name": "domain"},
                        "partitioner='domain': dataset digits has no domain attribute"),
                       ({"min-clients": 5, "node-timeout": 0.3}, "min-clients=5: only 4 nodes connected within "
                                                                "node-timeout=0.3 s")):
        fedapp_log.clear()
        run_config = {**all_defaults(), **flat, "out-dir": str(tmp_path), "run-name": "r"}
        with pytest.raises(Exception) as err:
            main(_NoClientWork(), Context(run_id=0, node_id=0, node_config={}, state=RecordDict(),
                                          run_config=run_config))
        assert line in str(err.value) and "\n" not in str(err.value)
        summary = json.loads((tmp_path / "r" / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["error"].endswith(str(err.value))
        records = [r for r in fedapp_log.records if r.name == "fedapp"]
        assert records[-1].levelname == "ERROR" and records[-1].getMessage() == str(err.value)
        assert any(r.getMessage().startswith("summary written to") for r in records[:-1])


# ---- Ray: `flwr run` starts its own ----------------------------------------------------------------------
def test_flwr_runs_simulation_process_starts_a_private_ray_unless_ray_address_names_one(tmp_path, monkeypatch):
    """flwr-simulation is Ray's driver; importing fedapp (as Flower does to load the ClientApp, before it calls
    ray.init) sets RAY_ADDRESS=local there, so Ray starts a new instance instead of joining the machine's
    latest `ray start` cluster. A RAY_ADDRESS the user set is kept; no other process is touched."""
    import os
    import subprocess
    import sys

    script = tmp_path / "flwr-simulation"  # sys.argv[0] as in Flower's console script
    script.write_text("import os, fedapp; print(repr(os.environ.get('RAY_ADDRESS')), "
                      "os.environ.get('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}

    def run(path, **extra):
        out = subprocess.run([sys.executable, str(path)], env={**env, **extra}, capture_output=True, text=True,
                             timeout=120, cwd=str(tmp_path))
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run(script) == "'local' 0"
    assert run(script, RAY_ADDRESS="10.0.0.5:6379") == "'10.0.0.5:6379' None"
    other = tmp_path / "driver.py"
    other.write_text(script.read_text())
    assert run(other) == "None None"
