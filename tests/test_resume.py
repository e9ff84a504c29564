"""Results that survive a stop: checkpoints and the final model in safetensors, a round-based run
resumed from its folder to the same final accuracy as an uninterrupted one, status "interrupted"."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import Error, Message

from fedapp.config import ConfigError
from fedapp.protocols import ROUND_KEY, RUN_KEY
from fedapp.server.checkpoint import CHECKPOINT_META, FINAL_MODEL, load_checkpoint
from fedapp.simulation import InProcessGrid, resolve_run_config, simulate_in_process

CFG = {"method": "fedavg", "dataset": "digits", "partitioner.name": "iid", "partitioner.per-class": 10,
       "num-server-rounds": 3, "local-epochs": 1, "min-clients": 3}


class _DiesInRound(InProcessGrid):
    """Every client fails the train message of one round, as if the federation went down."""

    def __init__(self, n, dead_round):
        super().__init__(n)
        self.dead_round = dead_round

    def deliver(self, msg):
        if msg.metadata.message_type == "train" and msg.content.config_records[RUN_KEY][ROUND_KEY] == self.dead_round:
            return Message(Error(code=0, reason="node went down"), reply_to=msg)
        return super().deliver(msg)


def test_a_stopped_run_resumes_to_the_same_final_accuracy(tmp_path):
    from fedapp.server_app import run_server

    whole = simulate_in_process({**CFG, "out-dir": str(tmp_path), "run-name": "whole"}, 3)
    flat, run_dir = resolve_run_config({**CFG, "out-dir": str(tmp_path), "run-name": "stopped"}, 3)
    with pytest.raises(RuntimeError, match="min-clients"):
        run_server(_DiesInRound(3, dead_round=3), flat)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
    assert json.loads((run_dir / CHECKPOINT_META).read_text())["round"] == 2

    resumed = simulate_in_process({**CFG, "out-dir": str(tmp_path), "resume": str(run_dir)}, 3)
    assert resumed["status"] == "completed" and resumed["resumed_after_round"] == 2
    assert resumed["metrics"]["accuracy"] == whole["metrics"]["accuracy"]
    rounds = [json.loads(line)["round"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2, 3]  # the stopped run's rounds, then the resumed one's, nothing twice
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "whole" / FINAL_MODEL)), load_file(str(run_dir / FINAL_MODEL))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert load_checkpoint(run_dir).round == 3


def test_resume_refuses_another_config_or_method(tmp_path):
    done = simulate_in_process({**CFG, "num-server-rounds": 1, "out-dir": str(tmp_path), "run-name": "r"}, 3)
    folder = done["run_dir"]
    with pytest.raises(ConfigError, match=r"^resume=.*: the run config differs in lr \(0.5 here, 0.02 in the run\)"):
        resolve_run_config({**CFG, "num-server-rounds": 1, "lr": 0.5, "resume": folder}, 3)
    # logging may change
    resolve_run_config({**CFG, "num-server-rounds": 1, "log.tensorboard": True, "resume": folder}, 3)
    with pytest.raises(ConfigError, match=r"method='espresso' is not resumable"):
        resolve_run_config({"method": "espresso", "resume": folder}, 3)
    with pytest.raises(ConfigError, match=r"not a run folder with config.json and a checkpoint"):
        resolve_run_config({**CFG, "resume": str(tmp_path)}, 3)
    with pytest.raises(ConfigError, match=r"method='centralized' is not resumable; allowed for the resumable "
                                          r"methods \(fedavg, fedprox, feddifrc\)"):  # one-shot: no checkpoint
        resolve_run_config({**CFG, "method": "centralized", "resume": folder}, 3)
    # a run folder written when config.json listed every method's keys resumes too: they are not this run's
    from pathlib import Path

    from fedapp.config import all_defaults

    config = Path(folder) / "config.json"
    every = {k: v for k, v in all_defaults().items() if "." in k and not k.startswith("partitioner.")}
    config.write_text(json.dumps({**every, **json.loads(config.read_text())}))
    resolve_run_config({**CFG, "num-server-rounds": 1, "resume": folder}, 3)


def test_an_interrupted_run_says_so(tmp_path):
    from fedapp.server_app import run_server

    class _CtrlC(InProcessGrid):
        def deliver(self, msg):
            raise KeyboardInterrupt

    flat, run_dir = resolve_run_config({**CFG, "out-dir": str(tmp_path), "run-name": "i"}, 3)
    with pytest.raises(KeyboardInterrupt):
        run_server(_CtrlC(3), flat)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["error"] == "KeyboardInterrupt"


def test_a_stopped_table_cell_continues_and_its_summary_counts_the_whole_run(tmp_path):
    """experiments.common.run on a config whose run stopped after round 2 (its federation went down in round 3)
    continues it from the checkpoint, to the accuracy and the per-client bytes and messages of a run that was
    never stopped: the checkpoint keeps what the run had spent (ServerRun.progress), the resumed summary adds it."""
    from experiments.common import run, stopped_run
    from fedapp.server_app import run_server

    cfg = {**CFG, "fraction-evaluate": 0.0, "out-dir": str(tmp_path)}  # the tables': no client evaluation
    whole = simulate_in_process({**cfg, "run-name": "whole"}, 3)
    flat, run_dir = resolve_run_config({**cfg, "run-name": "cell"}, 3)
    assert stopped_run(flat, 3) is None  # nothing to continue yet
    with pytest.raises(RuntimeError, match="min-clients"):
        run_server(_DiesInRound(3, dead_round=3), flat)
    kept = json.loads((run_dir / CHECKPOINT_META).read_text())
    assert kept["round"] == 2 and {c["messages_up"] for c in kept["progress"]["per_client"].values()} == {2}
    assert stopped_run(flat, 3) == str(run_dir)
    assert stopped_run({**flat, "lr": 0.5}, 3) is None  # another config starts over

    resumed = run(flat, 3, "inprocess")
    assert resumed["resumed_after_round"] == 2 and resumed["metrics"]["accuracy"] == whole["metrics"]["accuracy"]
    got, want = resumed["comm"]["per_client"], whole["comm"]["per_client"]
    assert got.keys() == want.keys() and resumed["comm"]["up_bytes"] == whole["comm"]["up_bytes"]
    for c in want:  # both parts: 3 train messages each way per client, the same bytes up
        assert (got[c]["messages_up"], got[c]["messages_down"], got[c]["up_bytes"]) == (3, 3, want[c]["up_bytes"])
        # down: the resumed round's message also carries `resume` (the folder's path) in its run config
        assert 0 < got[c]["down_bytes"] - want[c]["down_bytes"] < 2 * len(str(run_dir)) + 64
    assert set(resumed["phase_seconds"]) == set(whole["phase_seconds"])
    assert resumed["wall_seconds"] >= kept["progress"]["wall_seconds"]
    assert stopped_run(flat, 3) is None  # completed: a rerun starts over
