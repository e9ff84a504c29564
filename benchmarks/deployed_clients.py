"""A deployed FedAvg client's time per message against the same run's Ray actors, in one run.

    python benchmarks/deployed_clients.py [--rounds 6] [--modes subprocess warm ray] [--threads 1] [--out DIR]

On this machine's loopback, a SuperLink and 2 SuperNodes run the deployment section's run (FedAvg on digits, iid,
2 clients, fraction-evaluate 0) with `flwr run`, for `--rounds` rounds, in three modes:

- subprocess: `flower-supernode` as the deployment section starts it (Flower's default `--isolation subprocess`):
  its SuperExec starts a fresh `flwr-clientapp` process for every message;
- warm: `flower-supernode --isolation process` beside `python -m fedapp.deploy.warm_exec`: every message is a fork
  of a process that has Flower, torch and fedapp's ClientApp imported;
- ray: the same run as a Ray simulation (`fedapp.simulate`, 2 virtual SuperNodes of one CPU each): one actor
  process serves all of a client's messages.

Both nodes' shards are built before the runs and kept on disk (fedapp.shard_cache), as a node keeps them between
runs; every mode reads them there. Per train message:

- task (deployed modes): from the SuperExec's launch of the ClientApp task to its process' exit: the process,
  Flower pulling the message and the FAB, installing the FAB, loading the app, the handler, pushing the reply. For
  `subprocess`, a timing wrapper named `flwr-clientapp` first on the SuperNode's PATH; for `warm`, the launcher's
  own line per task;
- handler (every mode): the seconds the ClientApp handler reports with each reply (comm.json): on Ray, an actor's
  work on a message;
- server: the server's train phase per round (summary.json), Flower's transport and polling included.

The ratios are each deployed mode's task time, and its handler time, over Ray's handler time: what a deployed
message costs a node, and what its ClientApp's own work costs, against what a message costs a Ray actor.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from deployed_message import NUM_PARTITIONS, RUN_CONFIG  # noqa: E402
from local_federation import BIN, Federation, flower, free_port, wait_for  # noqa: E402
from experiments.cli import common_args, pin_threads  # noqa: E402

MODES = ("subprocess", "warm", "ray")
WARM_TASK = re.compile(r"task (\d+) exited with code (-?\d+) after ([\d.]+) s")
# flwr-clientapp wrapped: the seconds from its start to its exit, one line per task, in the node's task log
TIMED_CLIENTAPP = """#!/bin/sh
start=$(date +%s.%N)
"{real}" "$@"
rc=$?
echo "$start $(date +%s.%N) $rc" >> "$FEDAPP_BENCH_TASK_LOG"
exit $rc
"""


def keep_shards(run: dict) -> None:
    """Both partitions' shards on disk (FEDAPP_SHARD_CACHE), as a node keeps its own between runs."""
    from fedapp import data
    from fedapp.config import parse_run_config
    from fedapp.shard_cache import shard_path, write_shard

    cfg = parse_run_config(run)
    for k in range(NUM_PARTITIONS):
        write_shard(shard_path(cfg, k, NUM_PARTITIONS), data.client_shard(cfg, k, NUM_PARTITIONS))


def handler_seconds(run_dir: Path) -> list[float]:
    """Per client, its train messages' mean handler seconds (comm.json), once per message."""
    out = []
    for phases in json.loads((run_dir / "comm.json").read_text())["by_phase"].values():
        train = phases.get("train")
        if train and train["messages_up"]:
            out += [train["seconds"] / train["messages_up"]] * int(train["messages_up"])
    return out


def config_text(run: dict) -> str:
    return " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in run.items())


def deployed(mode: str, folder: Path, run: dict) -> dict:
    """One `flwr run` on a loopback SuperLink and NUM_PARTITIONS SuperNodes; the task seconds and the summary."""
    fed = Federation(folder)
    fed.env.update({"FEDAPP_SHARD_CACHE": os.environ["FEDAPP_SHARD_CACHE"],
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    shim = folder / "shim"
    shim.mkdir()
    (shim / "flwr-clientapp").write_text(TIMED_CLIENTAPP.format(real=BIN / "flwr-clientapp"))
    (shim / "flwr-clientapp").chmod(0o755)
    try:
        port = free_port()
        fed.superlink("127.0.0.1", port)
        fed.connection("loopback", f"127.0.0.1:{port}")
        nodes, execs = [], []
        for k in range(NUM_PARTITIONS):
            runtime = f"127.0.0.1:{free_port()}"
            isolation = ["--isolation", "process"] if mode == "warm" else []
            node = fed.start(f"node{k}", [flower("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
                                          *isolation, "--host", "127.0.0.1", "--port", runtime.rsplit(":", 1)[1],
                                          "--node-config", f"partition-id={k} num-partitions={NUM_PARTITIONS}"],
                             env={"PATH": f"{shim}{os.pathsep}{fed.env['PATH']}",
                                  "FEDAPP_BENCH_TASK_LOG": str(folder / f"tasks{k}.log")})
            nodes.append(node)
            if mode == "warm":
                execs.append(fed.start(f"exec{k}", [sys.executable, "-m", "fedapp.deploy.warm_exec",
                                                    "--runtime-api-address", runtime, "--insecure",
                                                    "--parent-pid", str(node.popen.pid)]))
        for node in nodes:
            wait_for(node, r"SuperNode ID", 120)
        for ex in execs:
            wait_for(ex, r"fork server ready", 300)
        res = fed.flwr("run", str(ROOT), "loopback", "--run-config", config_text(run), "--stream", timeout=900)
        (folder / "flwr-run.log").write_text(res.stdout + res.stderr)
        run_dir = Path(run["out-dir"]) / run["run-name"]
        if not (run_dir / "summary.json").exists():
            sys.exit(f"{mode}: no summary.json\n{res.stdout[-2000:]}{res.stderr[-2000:]}\n{fed.logs()}")
        if mode == "warm":
            found = [WARM_TASK.search(line) for ex in execs for line in ex.text().splitlines()]
            tasks = [(int(m.group(2)), float(m.group(3))) for m in found if m]
        else:
            logs = [(folder / f"tasks{k}.log").read_text() for k in range(NUM_PARTITIONS)]
            lines = [line.split() for text in logs for line in text.splitlines()]
            tasks = [(int(rc), float(end) - float(start)) for start, end, rc in lines]
    finally:
        fed.stop()
    failed = [code for code, _ in tasks if code != 0]
    if failed:
        sys.exit(f"{mode}: tasks exited with codes {failed}; logs under {folder}")
    return {"task": [s for _, s in tasks], "run_dir": run_dir}


def ray(folder: Path, run: dict) -> dict:
    import fedapp

    fedapp.simulate(run, num_clients=NUM_PARTITIONS, backend={"client_resources": {"num_cpus": 1}})
    return {"task": [], "run_dir": Path(run["out-dir"]) / run["run-name"]}


def measure(mode: str, folder: Path, rounds: int) -> dict:
    folder.mkdir(parents=True)
    run = {**RUN_CONFIG, "num-server-rounds": rounds, "out-dir": str(folder / "runs"), "run-name": mode}
    t0 = time.perf_counter()
    out = ray(folder, run) if mode == "ray" else deployed(mode, folder, run)
    summary = json.loads((out["run_dir"] / "summary.json").read_text())
    if summary["status"] != "completed":
        sys.exit(f"{mode}: the run ended {summary['status']}: {summary.get('error')}")
    return {"task": out["task"], "handler": handler_seconds(out["run_dir"]),
            "server_train_per_round": summary["phase_seconds"]["train"] / rounds,
            "accuracy": summary["metrics"]["accuracy"], "wall": time.perf_counter() - t0}


def report(results: dict, rounds: int) -> dict:
    """Print the table and the ratios to Ray's handler time; return the ratios."""
    mean = statistics.mean
    print(f"FedAvg on digits, {NUM_PARTITIONS} clients x {rounds} rounds, fraction-evaluate 0; per train message, "
          "mean (median) seconds")
    print(f"{'mode':>12} {'messages':>8} {'task s':>15} {'handler s':>15} {'task-handler s':>14} "
          f"{'server s/round':>14} {'accuracy':>8}")
    for mode, r in results.items():
        task = f"{mean(r['task']):.3f} ({statistics.median(r['task']):.3f})" if r["task"] else "-"
        handler = f"{mean(r['handler']):.3f} ({statistics.median(r['handler']):.3f})"
        outside = f"{mean(r['task']) - mean(r['handler']):.3f}" if r["task"] else "-"
        print(f"{mode:>12} {len(r['handler']):>8} {task:>15} {handler:>15} {outside:>14} "
              f"{r['server_train_per_round']:>14.2f} {r['accuracy']:>8.3f}")
    if "ray" not in results:
        return {}
    actor = mean(results["ray"]["handler"])
    ratios = {}
    for mode, r in results.items():
        if mode != "ray":
            ratios[mode] = {"task": mean(r["task"]) / actor, "handler": mean(r["handler"]) / actor}
            print(f"{mode} / ray: task {ratios[mode]['task']:.2f}x, handler {ratios[mode]['handler']:.2f}x "
                  "(of Ray's handler time)")
    return ratios


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[common_args(
        threads=1, out=None, helps={"out": "also write the figures to <out>/deployed_clients.json"})])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    a = p.parse_args()
    pin_threads(a.threads)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fedapp-deployed-") as tmp:
        os.environ["FEDAPP_SHARD_CACHE"] = str(Path(tmp) / "shards")
        keep_shards(RUN_CONFIG)
        results = {mode: measure(mode, Path(tmp) / mode, a.rounds) for mode in a.modes}
    ratios = report(results, a.rounds)
    print(f"load average (1 min) {load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end, "
          f"on {os.cpu_count()} cores")
    if a.out:
        from fedapp.results import atomic_write_json

        atomic_write_json(Path(a.out) / "deployed_clients.json", {
            "rounds": a.rounds, "threads": a.threads, "ratios": ratios,
            "results": {m: dict(r) for m, r in results.items()}})


if __name__ == "__main__":
    main()
