"""How fedapp's Ray simulation scales with the number of virtual clients.

FedAvg rounds, FedDifRC rounds (both sampling ~`--per-round` clients a round through Flower's
`fraction-train` = per-round / N) and Espresso's one shot, each through `fedapp.simulate` with N
virtual clients, on the digits set (8x8, split IID over all N) with tiny per-client work. Every run
is a fresh child process; this parent reads its log lines as they come (the server's round and phase
lines, fedapp.progress) and samples the RSS of the child and all its descendants (Ray's GCS, raylet
and workers) with psutil every 0.5 s:

- start-up: launch to the first round's (one shot: the train phase's) start line; it includes Python
  imports, Ray's start, the server's data and the initial global evaluation;
- s / round: the median of rounds 2.. ("round k/R done in X s"); round 1 also pays each actor's
  imports. For Espresso the one shot's phases: getting the prior to the nodes (ship-prior), the
  clients' train phase, synthesis, server training, the evaluate phase; per client, the train phase over N
  (its share of the phase on the actors) and the median of the seconds each client reports computing its
  upload (client-seconds: its prior and shard already loaded);
- peak RSS: of the whole process tree (sum over processes, at its highest sample), of each Ray node (a
  raylet and the workers it started: what that node's machine holds besides the driver and Ray's GCS,
  which sit on the head) and of the largest Ray actor (a `ray::ClientAppActor` worker);
- ratio: each figure over the method's first run (fewest clients, one node).

`--nodes 2` runs the simulation on a Ray cluster of 2 nodes on this machine's loopback (Ray's own
`cluster_utils.Cluster`: the processes `ray start --head` and `ray start --address=HEAD` start, 1 CPU
each, as tests/test_ray_cluster.py), joined through `fedapp.simulate(..., backend={"init_args":
{"address": ...}})`; `--nodes 1` (default) is fedapp's private one-node Ray with the machine's CPUs.
Both give Ray 2 CPUs here, so 2 actors.

A run that passes `--timeout` is stopped; the table then says where it was (the last server line and
how many clients had finished their part). FedDifRC and Espresso need the built-in tiny prior of
digit-styles (packaged with fedapp; installed into the prior cache on first use). Espresso ships it to
the nodes that lack it (the default `espresso.ship-prior=auto`: by digest, the weights in doubling waves);
each run starts as a fresh machine would, without received priors (`shipped-*` folders are removed from
the prior cache first; `--keep-received` keeps them), and the table gives the bytes each phase sent down.

    python benchmarks/scale.py [--methods fedavg feddifrc espresso espresso-sampled-eval] [--clients 10 100 1000]
                               [--nodes 1 2] [--rounds 3] [--per-round 10] [--timeout 900]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRIOR = "tiny:digit-styles"  # the built-in prior fedapp builds for the 8x8 sets (16 px)
COMMON = {"dataset": "digits", "partitioner.name": "iid", "partitioner.per-class": 0, "min-clients": 2, "seed": 0,
          "local-epochs": 1, "batch-size": 16}
METHODS = {
    "fedavg": {"method": "fedavg"},
    # without federated evaluation (fraction-evaluate = 0; the server's global test set only): at 1,000
    # clients digits leaves every client's test split empty, and the gate refuses an evaluate reply of 0
    # examples, so the default run stops there; FedDifRC's evaluate phase is FedAvg's, measured above
    "fedavg-server-eval": {"method": "fedavg", "fraction-evaluate": 0.0},
    "feddifrc": {"method": "feddifrc", "prior": PRIOR, "fraction-evaluate": 0.0},
    "espresso": {"method": "espresso", "prior": PRIOR, "espresso.embed-steps": 2, "espresso.steps": 2,
                 "espresso.ratio": 0.5, "espresso.mixup-pairs": 4, "espresso.diffusions-per-latent": 1,
                 "espresso.embed-batch": 8, "espresso.zigzag-t": 300, "server-epochs": 1},
}
# Espresso's evaluate phase on 10 clients (espresso.evaluate-clients), as a round of FedAvg trains 10, whatever N
METHODS["espresso-sampled-eval"] = {**METHODS["espresso"], "espresso.evaluate-clients": 10}
ROUND_BASED = {"fedavg", "fedavg-server-eval", "feddifrc"}


def run_config(method: str, clients: int, rounds: int, per_round: int, out: str, nodes: int = 1) -> dict:
    name = f"{method}-{clients}" + (f"-{nodes}nodes" if nodes > 1 else "")
    cfg = {**COMMON, **METHODS[method], "out-dir": out, "run-name": name}
    if method in ROUND_BASED:  # ~per_round clients train each round whatever N (Flower: max(int(N f), min-clients))
        fraction = min(1.0, (per_round + 0.5) / clients)
        cfg.update({"num-server-rounds": rounds, "fraction-train": fraction})
    return cfg


# ---- the child: one simulation ------------------------------------------------------------------------
def child(cfg: dict, clients: int, nodes: int) -> None:
    import torch

    import fedapp

    torch.set_num_threads(1)  # the two cores go to Ray's two actors
    backend, cluster = None, None
    if nodes > 1:  # a loopback Ray cluster of `nodes` nodes, 1 CPU each, joined by address
        from ray.cluster_utils import Cluster

        from fedapp.simulation import _keep_ray_on_loopback

        _keep_ray_on_loopback()
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0,
                                                                "include_dashboard": False})
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=1, num_gpus=0)
        cluster.wait_for_nodes()
        backend = {"init_args": {"address": cluster.address}}
    try:
        summary = fedapp.simulate(cfg, num_clients=clients, backend=backend)
    finally:
        if cluster is not None:
            cluster.shutdown()
    down: dict[str, int] = {}  # bytes down by message type, over all clients (comm.json)
    for phases in json.loads((Path(summary["run_dir"]) / "comm.json").read_text())["by_phase"].values():
        for mtype, b in phases.items():
            down[mtype] = down.get(mtype, 0) + b["down"]
    handler = sorted((summary.get("metrics") or {}).get("client_seconds", {}).values())  # Espresso: each upload's
    print("SCALE-SUMMARY " + json.dumps({"status": summary["status"], "wall_seconds": summary["wall_seconds"],
                                         "phase_seconds": summary["phase_seconds"], "down_bytes": down,
                                         "failures": len(summary["failures"]),
                                         "client_seconds_median": handler[len(handler) // 2] if handler else None}),
          flush=True)


# ---- the parent: launch, watch, measure ---------------------------------------------------------------
class Watch:
    """A child's log lines (with their times) and the peak RSS of its process tree and of its Ray actors."""

    def __init__(self, proc: subprocess.Popen, log_path: Path):
        import psutil

        self.proc, self.t0 = proc, time.time()
        self.lines: list[tuple[float, str]] = []
        self.peak_tree = self.peak_actor = 0
        self.peak_node: dict[int, int] = {}  # raylet pid -> peak RSS of it and the workers it started
        self.actors: set[int] = set()
        self._root = psutil.Process(proc.pid)
        self._log = log_path.open("w")
        self._threads = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._sample, daemon=True)]
        for t in self._threads:
            t.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time() - self.t0, line.rstrip("\n")))
            self._log.write(f"{self.lines[-1][0]:8.2f}  {line}")  # seconds since launch: where a run spends its time

    def _sample(self) -> None:
        import psutil

        while self.proc.poll() is None:
            try:
                procs = [self._root, *self._root.children(recursive=True)]
            except psutil.Error:
                break
            total, rss_of, kids, raylets = 0, {}, {}, []
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    head = " ".join(p.cmdline()[:1])
                    kids.setdefault(p.ppid(), []).append(p.pid)
                    if "ClientAppActor" in head:
                        self.actors.add(p.pid)
                        self.peak_actor = max(self.peak_actor, rss)
                    if head.endswith("/raylet"):
                        raylets.append(p)
                except psutil.Error:
                    continue
                rss_of[p.pid] = rss
                total += rss
            self.peak_tree = max(self.peak_tree, total)
            for r in raylets:  # a node: its raylet and the workers it started (from the tree just listed)
                node = sum(rss_of.get(pid, 0) for pid in subtree(r.pid, kids))
                self.peak_node[r.pid] = max(self.peak_node.get(r.pid, 0), node)
            time.sleep(0.5)

    def finish(self, timeout: float) -> tuple[float, bool]:
        """(wall seconds, timed out); a child over `timeout` is stopped with its whole session."""
        try:
            self.proc.wait(timeout=max(1.0, timeout - (time.time() - self.t0)))
            stopped = False
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            stopped = True
        wall = time.time() - self.t0
        self._threads[0].join(timeout=5)
        self._log.close()
        return wall, stopped

    def first(self, pattern: str) -> float | None:
        return next((t for t, line in self.lines if re.search(pattern, line)), None)

    def all(self, pattern: str) -> list[re.Match]:
        return [m for _, line in self.lines if (m := re.search(pattern, line))]


def subtree(pid: int, kids: dict[int, list[int]]) -> list[int]:
    """pid and every process below it, from a {parent pid: [child pids]} map."""
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo.extend(kids.get(out[-1], ()))
    return out


def measure(method: str, clients: int, nodes: int, args, out: str) -> dict:
    cfg = run_config(method, clients, args.rounds, args.per_round, out, nodes)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1",
           "RAY_DEDUP_LOGS": "0"}  # Ray merges log lines that differ only in numbers: every client's progress line
    proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(cfg), str(clients), str(nodes)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    log = Path(out) / f"{cfg['run-name']}.log"
    watch = Watch(proc, log)
    wall, stopped = watch.finish(args.timeout)
    row = {"method": method, "clients": clients, "nodes": nodes, "wall": wall, "stopped": stopped,
           "exit": proc.returncode, "peak_tree_mb": watch.peak_tree / 2**20, "peak_actor_mb": watch.peak_actor / 2**20,
           "peak_node_mb": [b / 2**20 for _, b in sorted(watch.peak_node.items())],
           "actors": len(watch.actors), "log": str(log)}
    done = watch.all(r"SCALE-SUMMARY (.*)")
    row["summary"] = json.loads(done[-1].group(1)) if done else None
    replies = {m.group(1): (int(m.group(2)), int(m.group(3)), float(m.group(4)))
               for m in watch.all(r"\[(\w+)\] (\d+)/(\d+) clients replied in ([\d.]+)s")}
    row["replies"] = replies  # the last of each phase
    if method in ROUND_BASED:
        row["startup"] = watch.first(r"round 1/\d+: ")
        rounds = [(int(m.group(1)), float(m.group(2))) for m in watch.all(r"round (\d+)/\d+ done in ([\d.]+) s")]
        row["round1"] = next((s for r, s in rounds if r == 1), None)
        later = [s for r, s in rounds if r > 1]
        row["per_round"] = statistics.median(later) if later else None
        trains = watch.all(r"round \d+/\d+: train on (\d+) of (\d+) clients")
        row["sampled"] = int(trains[-1].group(1)) if trains else None
        evals = watch.all(r"\[evaluate\] \d+/(\d+) clients replied in ([\d.]+)s")
        row["evals"] = [float(m.group(2)) for m in evals]
        row["eval_asked"] = int(evals[-1].group(1)) if evals else None
        row["trains"] = [float(m.group(1)) for m in watch.all(r"\[train\] \d+/\d+ clients replied in ([\d.]+)s")]
    else:
        row["startup"] = watch.first(r"\[(?:query\.prior|train)\] to \d+ clients")
        phases = {m.group(1): float(m.group(2)) for m in watch.all(r"^(?:INFO fedapp: )?([\w.-]+) done in ([\d.]+) s")}
        row["phases"] = phases
        row["per_round"] = (None if stopped or "classifier" not in phases else
                            phases.get("ship-prior", 0.0) + replies.get("train", (0, 0, 0.0))[2]
                            + phases.get("synthesis", 0.0)
                            + phases["classifier"] + replies.get("evaluate", (0, 0, 0.0))[2])
    if stopped or proc.returncode:
        finished = {int(m.group(1)) for m in watch.all(r"client (\d+): (?:noise GMMs|target prompts) (\d+)/\2,")}
        server = [line for _, line in watch.lines if line.startswith("INFO fedapp: ") and not
                  line.startswith("INFO fedapp: client ")]
        row["where"] = {"last_server_line": server[-1][len("INFO fedapp: "):] if server else None,
                        "clients_finished": len(finished), "at_s": watch.lines[-1][0] if watch.lines else None,
                        "error": next((m.group(0) for m in reversed(watch.all(r"^\w+Error: .*"))), None)}
    return row


def forget_received_priors() -> None:
    """Remove the priors this machine received from servers (shipped-* in the prior cache)."""
    import shutil

    sys.path.insert(0, str(ROOT))
    from fedapp.models.prior.tiny.cache import cache_root

    for folder in cache_root().glob("shipped-*"):
        shutil.rmtree(folder, ignore_errors=True)


def after_round1(seconds: list[float]) -> float | None:
    """Median of rounds 2.. (round 1 also pays each actor's imports)."""
    return statistics.median(seconds[1:]) if len(seconds) > 1 else None


def fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict], args) -> None:
    print(f"\nfedapp.simulate on {os.cpu_count()} cores, digits IID over N clients; round-based methods sample "
          f"~{args.per_round} clients a round (fraction-train = {args.per_round}/N), {args.rounds} rounds")
    head = ["method", "N", "Ray nodes", "start-up s", "round 1 s", "s / round", "× first run", "peak RSS MB",
            "× first run", "peak RSS per node MB", "actor peak MB", "actors", "note"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    base = {}  # each method's first run: fewest clients, then fewest nodes
    for r in sorted(rows, key=lambda r: (r["clients"], r["nodes"]), reverse=True):
        base[r["method"]] = r
    for r in rows:
        b = base[r["method"]]
        ratio = r["per_round"] / b["per_round"] if r["per_round"] and b["per_round"] else None
        mem = r["peak_tree_mb"] / b["peak_tree_mb"] if b["peak_tree_mb"] else None
        if r["method"] in ROUND_BASED:
            asked = r["eval_asked"] or "-"
            note = (f"train {fmt(after_round1(r['trains']), '.2f')} s + "
                    f"evaluate {asked} {fmt(after_round1(r['evals']), '.2f')} s")
        else:
            p = r.get("phases", {})
            down = (r["summary"] or {}).get("down_bytes", {})
            train = r["replies"].get("train", (0, 0, None))[2]
            note = (f"prior to the nodes {fmt(p.get('ship-prior'))} s "
                    f"({down.get('query.prior', 0) / 1e6:.1f} MB down), "
                    f"train {fmt(train)} s ({down.get('train', 0) / 1e6:.1f} MB down; a client "
                    f"{fmt(train and train / r['clients'], '.3f')} s of the phase, computing its upload "
                    f"{fmt((r['summary'] or {}).get('client_seconds_median'), '.3f')} s median), "
                    f"synthesis {fmt(p.get('synthesis'))} s, "
                    f"server training {fmt(p.get('classifier'))} s, "
                    f"evaluate {fmt(r['replies'].get('evaluate', (0, 0, None))[2])} s")
        if "where" in r:
            w = r["where"]
            status = ('STOPPED at ' + fmt(r['wall'], '.0f') + ' s' if r['stopped']
                      else 'FAILED (exit ' + str(r['exit']) + ')')
            note = (f"{status}"
                    f": {w['clients_finished']}/{r['clients']} clients done; "
                    f"last server line: {w['last_server_line']!r}"
                    + (f"; {w['error']}" if w["error"] else ""))
        per_node = " / ".join(f"{m:.0f}" for m in r["peak_node_mb"]) or "-"
        print(f"| {r['method']} | {r['clients']} | {r['nodes']} | {fmt(r['startup'])} | {fmt(r.get('round1'))} "
              f"| {fmt(r['per_round'], '.2f')} "
              f"| {fmt(ratio, '.2f')} | {r['peak_tree_mb']:.0f} | {fmt(mem, '.2f')} | {per_node} "
              f"| {r['peak_actor_mb']:.0f} | {r['actors']} | {note} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--clients", nargs="+", type=int, default=[10, 100, 1000])
    ap.add_argument("--nodes", nargs="+", type=int, default=[1],
                    help="Ray nodes: 1 = fedapp's private Ray; more = a loopback cluster, 1 CPU a node")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=10, help="clients sampled per round (round-based methods)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take before it is stopped")
    ap.add_argument("--keep", default=None, help="folder for the run folders and logs (default: a temp dir)")
    ap.add_argument("--keep-received", action="store_true",
                    help="keep the priors received by earlier runs (default: each run starts without them)")
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child[0]), int(args.child[1]), int(args.child[2]))
    out = args.keep or tempfile.mkdtemp(prefix="fedapp-scale-")
    Path(out).mkdir(parents=True, exist_ok=True)
    rows = []
    for method in args.methods:
        for n in args.clients:
            for nodes in args.nodes:
                if not args.keep_received:
                    forget_received_priors()
                row = measure(method, n, nodes, args, out)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print_table(rows, args)
    print(f"\nlogs and run folders: {out}")


if __name__ == "__main__":
    main()
