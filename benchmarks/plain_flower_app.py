"""A minimal Flower app in the shape of Flower's quickstart, doing fedapp's FedAvg work on digits:
the peer that benchmarks/sim_overhead.py measures fedapp against. Module level, so Ray's actors
import it by name. SETTINGS must equal the run config the benchmark gives fedapp."""

from __future__ import annotations

import json
import os

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from clients.classify import evaluate, local_train
from fedapp.models.classifier import build_classifier
from feddata import load_client_shard, load_server_data

# per-class from the environment: set by sim_overhead.py before Ray starts, so the actors see it too
SETTINGS = {"dataset": "digits", "partitioner": "iid",
            "params": {"per-class": int(os.environ.get("PLAIN_FLOWER_PER_CLASS", "0"))}, "seed": 0, "epochs": 3,
            "lr": 0.02, "batch": 16, "image_size": 16}
RESULT_ENV = "PLAIN_FLOWER_RESULT"  # where the ServerApp writes its final global accuracy (JSON)

client = ClientApp()
server = ServerApp()


def _shard(context: Context):
    s = SETTINGS
    return load_client_shard(s["dataset"], s["partitioner"], s["params"], s["seed"],
                             int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]),
                             image_size=s["image_size"])


def _model(msg: Message) -> torch.nn.Module:
    model = build_classifier("cnn", 10)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return model


@client.train()
def train(msg: Message, context: Context) -> Message:
    shard, model = _shard(context), _model(msg)
    rnd = int(msg.content["config"]["server-round"])
    local_train(model, shard.train.x, shard.train.y, epochs=SETTINGS["epochs"], lr=SETTINGS["lr"],
                batch=SETTINGS["batch"], seed=rnd * 1000 + int(context.node_config["partition-id"]))
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"num-examples": len(shard.train)})}), reply_to=msg)


@client.evaluate()
def evaluate_(msg: Message, context: Context) -> Message:
    shard, model = _shard(context), _model(msg)
    loss, acc = evaluate(model, shard.test.x, shard.test.y)
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": len(shard.test), "loss": loss,
                                                        "accuracy": acc})}), reply_to=msg)


@server.main()
def main(grid: Grid, context: Context) -> None:
    s, n = SETTINGS, int(os.environ["PLAIN_FLOWER_CLIENTS"])
    test = load_server_data(s["dataset"], s["partitioner"], s["params"], s["seed"], n, image_size=s["image_size"]).test
    torch.manual_seed(s["seed"])
    model = build_classifier("cnn", 10)
    last = {}

    def global_eval(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        last["accuracy"] = evaluate(model, test.x, test.y)[1]
        return MetricRecord({"accuracy": last["accuracy"]})

    FedAvg(min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n).start(
        grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=int(os.environ["PLAIN_FLOWER_ROUNDS"]),
        evaluate_fn=global_eval)
    with open(os.environ[RESULT_ENV], "w") as fh:
        json.dump(last, fh)
