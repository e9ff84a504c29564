"""What one deployed ClientApp message costs, stage by stage, against the same message in a warm process.

    python benchmarks/deployed_message.py [--messages 3] [--warm 3] [--threads 1]

The messages keep their shard in a fresh temporary folder (FEDAPP_SHARD_CACHE): the first is a node's first message.

A SuperNode (Flower 1.42, `--isolation subprocess`, the default) starts a fresh `flwr-clientapp` process for every
message it receives: each message pays the interpreter, its imports and its data again. A Ray actor of a simulation
keeps one process for all the messages of its clients. Here every cold message is a fresh Python process (this
script with --child) that answers one FedAvg train message as clients.classify.handle_train does, timing:

- process start: from the parent's spawn to the child's first line (interpreter, site);
- imports: Flower's app API (what flwr-clientapp loads before the app), torch, then `fedapp.client_app` (fedapp's
  own modules and what they import beyond those two);
- message in: the message deserialised from Flower's protobuf (flwr-clientapp's part, as it receives one);
- config: the run config record parsed (fedapp.client_app.Dispatcher);
- data and shard: the client's train/test split (ClientContext.shard): on the node's first message built from the
  dataset (rendering and partitioning import scikit-learn and flwr-datasets) and kept on its disk, on the later
  ones read from there (fedapp.shard_cache);
- model: the classifier built and loaded with the message's weights;
- training: local SGD (`local-epochs` over the shard);
- records: the reply's ArrayRecord and MetricRecord, wrapped in its Message;

then `--warm` more messages of the next rounds through the real ClientApp handler in the same process: what a Ray
actor spends on a message once its process is warm. Flower's own work around a message (the SuperNode's gRPC, the
flwr-clientapp process pulling and pushing it, serialising it) is not in either figure. A cold total over the warm
median is the deployed-to-actor ratio of the client's own work: for the node's first message and for the later ones.
The run config is the deployment section's (FedAvg on digits, 2 SuperNodes, fraction-evaluate 0), partition 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.cli import common_args, pin_threads  # noqa: E402
RUN_CONFIG = {"method": "fedavg", "dataset": "digits", "partitioner.name": "iid", "min-clients": 2,
              "fraction-evaluate": 0.0}
NUM_PARTITIONS = 2
STAGES = ("process start", "import flwr", "import torch", "import fedapp.client_app", "message in", "config",
          "data and shard", "model", "training", "records")


# ---- the child: one cold message ---------------------------------------------------------------------------------
def child(spawned: float, messages: Path, threads: int) -> dict:
    """Stage -> seconds of one cold message, and the warm messages' seconds (see the module docstring)."""
    t = {"process start": time.time() - spawned}
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        t[name] = now - mark
        mark = now

    import flwr.app  # noqa: F401 -- what flwr-clientapp has loaded before it loads the app
    import flwr.clientapp  # noqa: F401
    lap("import flwr")
    import torch  # noqa: F401 -- timed as its own stage; pin_threads then uses it
    pin_threads(threads)
    lap("import torch")
    import fedapp.client_app as client_app
    lap("import fedapp.client_app")
    first, *later = read_messages(messages)
    lap("message in")
    from clients.classify import local_train, model_from_message, round_of, train_reply
    from fedapp.client_context import ClientContext
    from fedapp.data import for_classifier
    from flwr.app import Message

    context = node_context()
    dispatch = client_app.Dispatcher()
    cfg = dispatch.run_config_of(first)
    lap("config")
    ctx = ClientContext(cfg=cfg, partition_id=0, num_partitions=NUM_PARTITIONS, state=context.state)
    shard = ctx.shard  # the node's kept shard when an earlier message left it (fedapp.shard_cache)
    lap("data and shard")
    model = model_from_message(first, ctx)
    lap("model")
    stats = local_train(model, for_classifier(shard.train.x, cfg), shard.train.y, epochs=cfg.local_epochs,
                        lr=cfg.lr, batch=cfg.batch_size, seed=ctx.seed_for(round_of(first)), device="cpu")
    lap("training")
    Message(train_reply(model, len(shard.train), {f"train_{k}": v for k, v in stats.items()}), reply_to=first)
    lap("records")

    warm_s = []
    for m in later:  # the next rounds' messages through the app's handler, as a Ray actor serves them
        t0 = time.perf_counter()
        dispatch(m, context)
        warm_s.append(time.perf_counter() - t0)
    return {"stages": t, "warm": warm_s, "train_examples": len(shard.train), "local_epochs": cfg.local_epochs}


def read_messages(path: Path) -> list:
    """The train messages `write_messages` left, deserialised with Flower's protobuf serde (as flwr-clientapp
    receives a message)."""
    from flwr.app import Message
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # flwr-clientapp's task, as it pulls one
    data, out, at = path.read_bytes(), [], 0
    while at < len(data):
        n = int.from_bytes(data[at:at + 8], "little")
        content = recorddict_from_proto(ProtoRecordDict.FromString(data[at + 8:at + 8 + n]))
        out.append(Message(content, dst_node_id=1, message_type="train"))
        at += 8 + n
    return out


def node_context():
    from flwr.app import Context, RecordDict

    return Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": NUM_PARTITIONS},
                   state=RecordDict(), run_config={})


# ---- the parent ------------------------------------------------------------------------------------------------
def write_messages(path: Path, rounds: int) -> None:
    """Rounds 1..rounds of FedAvg's train message as the server sends them (the resolved run config with the round,
    the global weights), serialised as Flower's protobuf, each prefixed by its length."""
    import torch
    from flwr.common.serde import recorddict_to_proto
    from flwr.app import RecordDict

    from fedapp.config import parse_run_config
    from fedapp.models.classifier import build_classifier
    from fedapp.protocols import ARRAYS_KEY, ROUND_KEY, RUN_KEY
    from fedapp.protocols.records import run_config_record
    from fedapp.protocols.weights import weights_record

    cfg = parse_run_config(RUN_CONFIG)
    torch.manual_seed(0)
    weights = weights_record(build_classifier(cfg.model, 10).state_dict())  # packed, as the server sends it
    blobs = [recorddict_to_proto(RecordDict({RUN_KEY: run_config_record(cfg.flat(), **{ROUND_KEY: r}),
                                             ARRAYS_KEY: weights})).SerializeToString() for r in range(1, rounds + 1)]
    path.write_bytes(b"".join(len(b).to_bytes(8, "little") + b for b in blobs))


def cold_message(messages: Path, shards: Path, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FEDAPP_SHARD_CACHE": str(shards)}  # OMP_NUM_THREADS: pin_threads
    spawned = time.time()
    out = subprocess.run([sys.executable, __file__, "--child", repr(spawned), "--path", str(messages),
                          "--threads", str(threads)], capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if out.returncode != 0:
        sys.exit(f"the child process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[common_args(threads=1)])
    p.add_argument("--messages", type=int, default=3, help="cold messages after the node's first (fresh processes)")
    p.add_argument("--warm", type=int, default=3, help="warm messages after each cold one, in its process")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        print(json.dumps(child(float(a.child), Path(a.path), a.threads)))
        return
    pin_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        messages = Path(tmp) / "messages.bin"
        write_messages(messages, 1 + a.warm)
        runs = [cold_message(messages, Path(tmp) / "shards", a.threads) for _ in range(1 + a.messages)]
    first, later = runs[0], runs[1:]  # the node's first message builds its shard and keeps it; the later read it
    stages = {s: statistics.median(r["stages"][s] for r in later) for s in STAGES}
    cold_first = sum(first["stages"].values())
    cold = statistics.median(sum(r["stages"].values()) for r in later)
    warm = statistics.median(w for r in runs for w in r["warm"])
    print(f"FedAvg train message, digits, partition 0 of {NUM_PARTITIONS}: {first['train_examples']} training "
          f"images x {first['local_epochs']} local epochs; {a.threads} thread(s); a node's first message, the "
          f"median of {a.messages} later ones (fresh processes) and of {len(runs) * a.warm} warm ones")
    print(f"{'stage':>26} {'first s':>8} {'later s':>8} {'share':>6}")
    for s in STAGES:
        print(f"{s:>26} {first['stages'][s]:>8.3f} {stages[s]:>8.3f} {100 * stages[s] / cold:>5.1f}%")
    print(f"{'cold message, total':>26} {cold_first:>8.3f} {cold:>8.3f}")
    print(f"{'warm message (Ray actor)':>26} {warm:>17.3f}")
    print(f"deployed / warm: first message {cold_first / warm:.2f}x, later messages {cold / warm:.2f}x")

if __name__ == "__main__":
    main()
