"""A soak under faults: many FedAvg rounds over many clients with some clients failing at random, and a run
killed mid-round and resumed.

The soak. FedAvg on the built-in digits (the default `cnn` classifier) served in this process by
`fedapp.simulation.InProcessGrid` (the ClientApp's own handler, one client after another), wrapped in a
`FaultyGrid` that makes each message's client, at random (seeded by the run seed, the message type, the round
and the partition id):

- raise: its handler raises before any work; the client's reply is the error reply a ClientApp sends;
- answer late: it does the work, but its reply arrives after the round's timeout, so the grid hands the server
  only the replies that came in time, as Flower's grid does (it pulls replies by the ids of the messages it
  sent, so a late reply never reaches a later round).

Per round the soak records the clients asked, those that raised or answered late, the valid replies, the
server's own failure records for the round (summary.json's `failures`, checked against the injected faults
node by node), whether the next global model is the num-examples-weighted mean of exactly that round's valid
replies (max |difference| against a float64 mean of them, tolerance `MEAN_TOL`), and the RSS of this process,
which holds the server and the in-process clients. "Memory flat": the least-squares slope of RSS over the last
half of the rounds is below `--flat-mib` MiB per 100 rounds (one leaked copy of the 1.5 MiB model a round
would be 154).

The resume check, for every method whose MethodSpec says `resumable`, at a tiny size with the same faults:
an uninterrupted run; the same run in a child process killed with SIGKILL in the middle of a round (after half
of that round's train messages were answered: nothing is written on the way out, summary.json still says
"running"); then `resume = <its folder>` in this process. The resumed run's final model.safetensors must equal
the uninterrupted run's (max |difference| <= `RESUME_TOL`; measured: exactly equal).

    python benchmarks/soak.py [--rounds 200] [--clients 100] [--fraction-train 0.5] [--fail-rate 0.05]
                              [--late-rate 0.05] [--seed 0] [--flat-mib 10] [--methods all] [--out docs/results/soak]

writes `<out>/soak.json` (atomically) and `<out>/soak.png`, prints the verdicts and exits 1 when one fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/soak.py` from anywhere
    sys.path.insert(0, str(ROOT))

from fedapp.protocols import ARRAYS_KEY, METRICS_KEY, NUM_EXAMPLES_KEY, ROUND_KEY, RUN_KEY  # noqa: E402
from fedapp.seeds import derive_seed  # noqa: E402
from experiments.cli import common_args  # noqa: E402
from fedapp.simulation import InProcessGrid  # noqa: E402

MEAN_TOL = 1e-5  # Flower averages in float32, the check in float64: 50 replies differ by ~1e-7
RESUME_TOL = 1e-6  # the resumed final model against the uninterrupted one
SOAK = {"method": "fedavg", "dataset": "digits", "partitioner.name": "iid", "partitioner.per-class": 0,
        "local-epochs": 1, "min-clients": 10, "fraction-evaluate": 0.5, "evaluate-every": 10,
        "round-timeout": 30.0}
RAISE, LATE, OK = "raise", "late", "ok"


class InjectedFault(RuntimeError):
    """What a client that the fault plan makes raise raises."""


@dataclass(frozen=True)
class FaultPlan:
    """Which client fails which message: a pure function of (seed, message type, round, partition), so an
    interrupted run and its resumption meet the faults an uninterrupted run meets."""

    fail_rate: float = 0.0
    late_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for key, value in (("fail-rate", self.fail_rate), ("late-rate", self.late_rate)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{key}={value!r}: must be a number in [0, 1]")
        if self.fail_rate + self.late_rate > 1.0:
            raise ValueError(f"fail-rate + late-rate={self.fail_rate + self.late_rate:g}: must be at most 1")

    def fate(self, message_type: str, server_round: int, partition: int) -> str:
        u = random.Random(derive_seed("fault", self.seed, message_type, server_round, partition)).random()
        return RAISE if u < self.fail_rate else LATE if u < self.fail_rate + self.late_rate else OK


class WeightedMean:
    """The num-examples-weighted mean of train replies' arrays, in float64: what FedAvg must make of them."""

    def __init__(self) -> None:
        self.total: dict[str, np.ndarray] = {}
        self.weight = 0.0
        self.count = 0

    def add(self, content: Any) -> None:
        w = float(content.metric_records[METRICS_KEY][NUM_EXAMPLES_KEY])
        for k, a in content.array_records[ARRAYS_KEY].items():
            x = a.numpy().astype(np.float64) * w
            self.total[k] = self.total[k] + x if k in self.total else x
        self.weight += w
        self.count += 1

    def max_abs_diff(self, model: dict[str, np.ndarray]) -> float:
        """max |model - mean| over every array; inf when the keys differ or nothing was added."""
        if not self.count or set(model) != set(self.total):
            return float("inf")
        return max(float(np.max(np.abs(np.asarray(model[k], np.float64) - t / self.weight)))
                   for k, t in self.total.items())


def round_of(msg: Any) -> int:
    return int(msg.content.config_records[RUN_KEY].get(ROUND_KEY, 0))


class FaultyGrid(InProcessGrid):
    """An InProcessGrid whose clients fail as `plan` says (module doc). It keeps a row per phase and round
    (`rows`) and checks each train round's aggregate when the next round's model goes out (`close`).
    `pause(message_type, round, index)`, when given, runs before the message of that index (in node order) is
    delivered: the resume check stops a child process there."""

    def __init__(self, num_nodes: int, plan: FaultPlan,
                 pause: Callable[[str, int, int], None] | None = None):
        super().__init__(num_nodes)
        self.plan, self.pause = plan, pause
        self.rows: list[dict[str, Any]] = []
        self._pending: tuple[dict, WeightedMean] | None = None  # the last train round's row and its valid mean
        self._handler, self._fate = self.dispatch, OK
        self.dispatch = self._dispatch  # InProcessGrid.deliver calls it; what it raises becomes an error reply

    def _dispatch(self, msg: Any, context: Any) -> Any:
        if self._fate == RAISE:
            raise InjectedFault("injected by the soak's fault plan")
        return self._handler(msg, context)

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list:
        messages = sorted(messages, key=lambda m: m.metadata.dst_node_id)
        if not messages:
            return []
        mtype, rnd = messages[0].metadata.message_type, round_of(messages[0])
        if mtype == "train":
            self.close({k: a.numpy() for k, a in messages[0].content.array_records[ARRAYS_KEY].items()})
        row = {"phase": mtype, "round": rnd, "asked": len(messages), RAISE: [], LATE: [], "valid": 0}
        mean = WeightedMean()
        replies = []
        for i, msg in enumerate(messages):
            if self.pause is not None:
                self.pause(mtype, rnd, i)
            pid = self.nodes[msg.metadata.dst_node_id].node_config["partition-id"]
            fate = self.plan.fate(mtype, rnd, pid)
            reply = self._deliver_as(fate, msg)
            if fate != OK:
                row[fate].append(msg.metadata.dst_node_id)
            if fate == LATE:  # done, but after `timeout`: the grid has returned without it
                continue
            replies.append(reply)
            if not reply.has_error():
                row["valid"] += 1
                if mtype == "train":
                    mean.add(reply.content)
        self.rows.append(row)
        if mtype == "train":
            self._pending = (row, mean)
        return replies

    def _deliver_as(self, fate: str, msg: Any) -> Any:
        """The reply of `msg`'s client under its fate (a raising client's handler raises inside
        InProcessGrid.deliver, which turns it into the error reply a ClientApp sends)."""
        self._fate = fate
        try:
            return self.deliver(msg)
        finally:
            self._fate = OK

    def close(self, model: dict[str, np.ndarray]) -> None:
        """Check the last train round's valid replies against `model`, the global model made of them (the
        next round's, or the run's final model.safetensors)."""
        if self._pending is not None:
            row, mean = self._pending
            row["mean_max_abs_diff"] = mean.max_abs_diff(model)
            self._pending = None


# ---- memory ----------------------------------------------------------------------------------------------
def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def slope_per_100(rounds: list[float], values: list[float]) -> float:
    """Least-squares slope of `values` against `rounds`, in units per 100 rounds."""
    if len(rounds) < 2:
        raise ValueError(f"a slope needs at least 2 points, got {len(rounds)}")
    return float(np.polyfit(np.asarray(rounds, float), np.asarray(values, float), 1)[0] * 100)


def memory_verdict(rounds: list[int], rss: list[float], flat_mib: float) -> dict[str, Any]:
    """RSS start/end, the slope over the last half of the rounds (MiB per 100 rounds) and whether it is
    below `flat_mib`: the first half holds the allocator's and caches' warm-up, the second a leak's trend."""
    half = len(rounds) // 2
    slope = slope_per_100(rounds[half:], rss[half:]) if len(rounds) - half >= 2 else None  # a run that died early
    return {"rss_start_mib": round(rss[0], 1) if rss else None, "rss_end_mib": round(rss[-1], 1) if rss else None,
            "rss_max_mib": round(max(rss), 1) if rss else None,
            "slope_last_half_mib_per_100_rounds": None if slope is None else round(slope, 3),
            "threshold_mib_per_100_rounds": flat_mib, "flat": slope is not None and slope < flat_mib}


# ---- the soak --------------------------------------------------------------------------------------------
class SoakGrid(FaultyGrid):
    """A FaultyGrid that also samples this process' RSS after each train phase, and every `objects_every`
    rounds the Python objects alive after a full collection (a leak of Python objects shows there; a
    collection costs ~1 s on this heap, so not every round)."""

    def __init__(self, num_nodes: int, plan: FaultPlan, objects_every: int = 10):
        super().__init__(num_nodes, plan)
        self.objects_every, self.t0 = objects_every, time.time()

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list:
        replies = super().send_and_receive(messages, timeout=timeout)
        row = self.rows[-1] if self.rows else None
        if row is not None and "seconds" not in row:
            row["seconds"] = round(time.time() - self.t0, 2)  # since the soak's first message
            if row["phase"] == "train":
                row["rss_mib"] = round(rss_mib(), 2)
                if row["round"] % self.objects_every == 0:
                    gc.collect()
                    row["py_objects"] = len(gc.get_objects())
                    print(f"round {row['round']}: {row['valid']}/{row['asked']} valid, "
                          f"{len(row[RAISE])} raised, {len(row[LATE])} late, RSS {row['rss_mib']:.0f} MiB, "
                          f"{row['seconds']:.0f} s", flush=True)
        return replies


def server_records(rows: list[dict], failures: list[dict]) -> None:
    """Attach to each row the server's failure records of its phase and round: summary.json lists them in
    the order the server made them, so a phase's records are, round after round, blocks of as many entries
    as that round had faults. A row's `server_recorded` is True when its block names exactly its faulty
    nodes, each with the reason its fault gives (an error reply: "client error"; a late one: "no reply")."""
    by_phase: dict[str, list[dict]] = {}
    for f in failures:
        by_phase.setdefault(f["phase"], []).append(f)
    at: dict[str, int] = {}  # per phase: the records the rows so far account for
    for row in rows:
        phase, n = row["phase"], len(row[RAISE]) + len(row[LATE])
        start = at.get(phase, 0)
        block, at[phase] = by_phase.get(phase, [])[start:start + n], start + n
        want = {(node, "client error") for node in row[RAISE]} | {(node, "no reply") for node in row[LATE]}
        got = {(f["node_id"], "client error" if f["reason"].startswith("client error")
                else "no reply" if f["reason"].startswith("no reply") else f["reason"]) for f in block}
        row["server_recorded"] = len(block) == n and got == want
    for row in rows:  # records after the last fault's block: failures no injected fault explains
        if len(by_phase.get(row["phase"], [])) > at[row["phase"]]:
            row["server_recorded"] = False


def final_model(run_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(Path(run_dir) / "model.safetensors"))


def final_weights(run_dir: Path, flat: dict[str, Any]) -> dict[str, np.ndarray]:
    """The run's final model.safetensors packed as a train message carries it (fedapp.protocols.weights: in the
    order of the run's classifier's state_dict), for the last round's mean check."""
    from safetensors.torch import load_file

    from fedapp.config import parse_run_config
    from fedapp.models.classifier import build_classifier
    from fedapp.protocols.weights import WEIGHTS, pack
    from feddata import dataset_info

    cfg = parse_run_config(flat)  # the layout needs the class count only, not the server's split
    like = build_classifier(cfg.model, dataset_info(cfg.dataset, image_size=cfg.image_size).num_classes).state_dict()
    saved = load_file(str(Path(run_dir) / "model.safetensors"))
    return {WEIGHTS: pack({k: saved[k] for k in like}).numpy()}


def run_soak(rounds: int, clients: int, plan: FaultPlan, out_dir: str | Path, fraction_train: float = 0.5,
             flat_mib: float = 10.0, extra: dict | None = None) -> dict[str, Any]:
    """One FedAvg run of `rounds` rounds over `clients` in-process clients failing as `plan` says; the
    per-round rows and the verdicts (module doc)."""
    from fedapp.server_app import run_server
    from fedapp.simulation import resolve_run_config

    cfg = {**SOAK, "num-server-rounds": rounds, "fraction-train": fraction_train, "seed": plan.seed,
           "out-dir": str(out_dir), "run-name": f"soak-{rounds}x{clients}", **(extra or {})}
    flat, run_dir = resolve_run_config(cfg, clients)
    grid = SoakGrid(clients, plan)
    t0, cpu0 = time.time(), time.process_time()
    error = None
    try:
        run_server(grid, flat)
    except Exception as err:  # noqa: BLE001 - the verdict says the run died, and why
        error = f"{type(err).__name__}: {err}"
    wall, cpu = time.time() - t0, time.process_time() - cpu0
    summary = json.loads((run_dir / "summary.json").read_text())
    if error is None:
        grid.close(final_weights(run_dir, flat))
    server_records(grid.rows, summary["failures"])
    train = [r for r in grid.rows if r["phase"] == "train"]
    mem = memory_verdict([r["round"] for r in train], [r["rss_mib"] for r in train], flat_mib)
    faults = {kind: sum(len(r[kind]) for r in grid.rows) for kind in (RAISE, LATE)}
    checks = {
        "completed": summary["status"] == "completed" and error is None,
        "every_round_trained": [r["round"] for r in train] == list(range(1, rounds + 1)),
        "aggregate_is_mean_of_valid_replies": all(r.get("mean_max_abs_diff", float("inf")) <= MEAN_TOL
                                                  for r in train),
        "server_recorded_every_fault": (all(r["server_recorded"] for r in grid.rows)
                                        and len(summary["failures"]) == faults[RAISE] + faults[LATE]),
        "memory_flat": mem["flat"],
    }
    return {
        "config": {"rounds": rounds, "clients": clients, "fraction_train": fraction_train,
                   "fail_rate": plan.fail_rate, "late_rate": plan.late_rate, "seed": plan.seed,
                   "run_config": cfg, "mean_tolerance": MEAN_TOL},
        "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1), "error": error, "status": summary["status"],
        "final_accuracy": (summary.get("metrics") or {}).get("accuracy"),
        "faults": {"messages": sum(r["asked"] for r in grid.rows), "raised": faults[RAISE], "late": faults[LATE],
                   "server_failure_records": len(summary["failures"]),
                   "train_rounds_with_a_fault": sum(bool(r[RAISE] or r[LATE]) for r in train),
                   "max_faults_in_a_train_round": max((len(r[RAISE]) + len(r[LATE]) for r in train), default=0)},
        "memory": mem, "checks": checks, "passed": all(checks.values()),
        "rows": [{**r, RAISE: len(r[RAISE]), LATE: len(r[LATE])} for r in grid.rows],
    }


# ---- killed mid-round, resumed ---------------------------------------------------------------------------
def resume_config(method: str, prior_dir: str | None) -> dict[str, Any]:
    """A tiny run of `method` on digits; methods with a prior get `prior_dir` (a random-weight tiny prior:
    what is checked is that a run continues exactly, not what it learns)."""
    from fedapp import registry

    cfg = {"method": method, "dataset": "digits", "partitioner.name": "iid", "partitioner.per-class": 4,
           "local-epochs": 1, "min-clients": 2, "num-server-rounds": 3, "fraction-evaluate": 0.0,
           "round-timeout": 30.0, "device": "cpu"}
    if registry.METHODS[method].uses_prior:
        cfg["prior"] = prior_dir
    if method == "feddifrc":  # the test prior has 2 up-blocks
        cfg["feddifrc.up-blocks"] = "0,1"
    return cfg


def _stop_here(conn: Any, kill_round: int, kill_index: int) -> Callable[[str, int, int], None]:
    def pause(mtype: str, rnd: int, index: int) -> None:
        if mtype == "train" and rnd == kill_round and index == kill_index:
            conn.send(("mid-round", rnd, index))
            time.sleep(3600)  # the parent kills this process now
    return pause


def serve_until_killed(flat: dict, clients: int, plan: FaultPlan, kill_round: int, conn: Any) -> None:
    """The child: the server loop of `flat`, which stops in the middle of `kill_round`'s train phase."""
    import torch

    torch.set_num_threads(1)
    from fedapp.progress import setup_logging
    from fedapp.server_app import run_server

    setup_logging()
    logging.getLogger("fedapp").setLevel(logging.ERROR)
    run_server(FaultyGrid(clients, plan, pause=_stop_here(conn, kill_round, clients // 2)), flat)
    conn.send(("finished", None, None))


def kill_mid_round(flat: dict, clients: int, plan: FaultPlan, kill_round: int, wait_s: float = 300) -> int:
    """Run `flat` in a child process and SIGKILL it in the middle of `kill_round`; its exit code."""
    # fork where there is one: the child starts with this process' imports (spawn re-imports torch and Flower)
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve_until_killed, args=(flat, clients, plan, kill_round, child), daemon=True)
    proc.start()
    try:
        deadline = time.time() + wait_s
        while not parent.poll(0.2):
            if not proc.is_alive() or time.time() > deadline:
                raise RuntimeError(f"the child (exit code {proc.exitcode}) did not reach the middle of round "
                                   f"{kill_round}")
        if parent.recv()[0] != "mid-round":
            raise RuntimeError(f"the child finished without reaching the middle of round {kill_round}")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.join(30)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
    return proc.exitcode


def max_model_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a)


def resume_check(method: str, out_dir: str | Path, plan: FaultPlan, clients: int = 4, kill_round: int = 2,
                 prior_dir: str | None = None) -> dict[str, Any]:
    """Uninterrupted, killed in the middle of `kill_round` and resumed: the two final models (module doc)."""
    from fedapp.server.checkpoint import load_checkpoint
    from fedapp.server_app import run_server
    from fedapp.simulation import resolve_run_config

    base = {**resume_config(method, prior_dir), "seed": plan.seed, "out-dir": str(out_dir)}
    whole_flat, whole_dir = resolve_run_config({**base, "run-name": f"{method}-whole"}, clients)
    run_server(FaultyGrid(clients, plan), whole_flat)
    flat, run_dir = resolve_run_config({**base, "run-name": f"{method}-killed"}, clients)
    exitcode = kill_mid_round(flat, clients, plan, kill_round)
    after_kill = json.loads((run_dir / "summary.json").read_text())["status"]
    checkpoint_round = load_checkpoint(run_dir).round
    resumed_flat, _ = resolve_run_config({**base, "run-name": f"{method}-killed", "resume": str(run_dir)}, clients)
    resumed = run_server(FaultyGrid(clients, plan), resumed_flat)
    diff = max_model_diff(final_model(whole_dir), final_model(run_dir))
    result = {"method": method, "clients": clients, "rounds": base["num-server-rounds"], "killed_in_round": kill_round,
              "exit_code": exitcode, "status_after_kill": after_kill, "checkpoint_round": checkpoint_round,
              "resumed_after_round": resumed.get("resumed_after_round"), "status": resumed["status"],
              "final_model_max_abs_diff": diff, "tolerance": RESUME_TOL}
    result["passed"] = (exitcode == -signal.SIGKILL and after_kill == "running"
                        and checkpoint_round == kill_round - 1 and resumed["status"] == "completed"
                        and diff <= RESUME_TOL)
    return result


def random_prior(folder: Path) -> str:
    """A random-weight tiny prior (the tests' TEST_CONFIG) saved in `folder`."""
    from fedapp.models.prior.tiny import TEST_CONFIG, random_tiny_prior

    return str(random_tiny_prior(TEST_CONFIG, seed=3).save_pretrained(folder / "tiny"))


def resumable_methods() -> list[str]:
    from fedapp import registry

    return registry.names(lambda s: s.resumable)


def resume_checks(methods: list[str], out_dir: Path, plan: FaultPlan) -> list[dict[str, Any]]:
    from fedapp import registry

    prior = random_prior(out_dir) if any(registry.METHODS[m].uses_prior for m in methods) else None
    return [resume_check(m, out_dir, plan, prior_dir=prior) for m in methods]


def cpu_seconds() -> float:
    """CPU time of this process and of the children it has waited for (the killed servers)."""
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


# ---- output ----------------------------------------------------------------------------------------------
def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in result["rows"] if r["phase"] == "train"]
    rounds = [r["round"] for r in train]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    ax.plot(rounds, [r["rss_mib"] for r in train], lw=1)
    m = result["memory"]
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(f"slope over the last half: {m['slope_last_half_mib_per_100_rounds']:+.2f} MiB / 100 rounds "
                 f"(flat below {m['threshold_mib_per_100_rounds']:g})", fontsize=9)
    bx.bar(rounds, [r["valid"] for r in train], width=1.0, label="valid replies (aggregated)")
    bx.bar(rounds, [r[RAISE] + r[LATE] for r in train], width=1.0, bottom=[r["valid"] for r in train],
           label="raised or late", color="tab:red")
    bx.set_xlabel("round")
    bx.set_ylabel("clients")
    bx.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    from io import BytesIO

    from fedapp.results import atomic_write_bytes

    buf = BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def main(argv: list[str] | None = None) -> int:
    shared = common_args(out=str(ROOT / "docs" / "results" / "soak"),
                         helps={"out": "folder of soak.json and soak.png"})
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[shared])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--fraction-train", type=float, default=0.5)
    p.add_argument("--fail-rate", type=float, default=0.05)
    p.add_argument("--late-rate", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flat-mib", type=float, default=10.0, help="memory flat: RSS slope below this, MiB / 100 rounds")
    p.add_argument("--methods", nargs="*", default=["all"], help="resumable methods to kill and resume ('all')")
    args = p.parse_args(argv)
    try:
        plan = FaultPlan(args.fail_rate, args.late_rate, args.seed)
    except ValueError as err:
        p.exit(2, f"soak.py: {err}\n")
    methods = resumable_methods() if args.methods == ["all"] else args.methods
    unknown = sorted(set(methods) - set(resumable_methods()))
    if unknown:
        p.exit(2, f"soak.py: --methods {' '.join(unknown)}: not resumable; allowed: {', '.join(resumable_methods())}\n")
    import torch

    torch.set_num_threads(1)
    from fedapp.progress import setup_logging

    setup_logging()
    logging.getLogger("fedapp").setLevel(logging.ERROR)  # the faults' failure lines: summary.json has them
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="fedapp-soak-") as tmp:
        t0, cpu0 = time.time(), cpu_seconds()
        result = run_soak(args.rounds, args.clients, plan, tmp, args.fraction_train, args.flat_mib)
        keys = ("wall_seconds", "cpu_seconds", "status", "faults", "memory", "checks")
        print(f"soak: {json.dumps({k: result[k] for k in keys})}", flush=True)
        result["resume"] = resume_checks(methods, Path(tmp), plan)
        result["total_wall_seconds"] = round(time.time() - t0, 1)
        result["total_cpu_seconds"] = round(cpu_seconds() - cpu0, 1)
    for r in result["resume"]:
        print(f"resume {r['method']}: {json.dumps(r)}", flush=True)
    result["passed"] = result["passed"] and all(r["passed"] for r in result["resume"])
    result["command"] = " ".join(["python benchmarks/soak.py", *(argv if argv is not None else sys.argv[1:])])
    from fedapp.results import atomic_write_json

    atomic_write_json(out / "soak.json", result)
    plot(result, out / "soak.png")
    print(f"{'PASSED' if result['passed'] else 'FAILED'}: {out / 'soak.json'}, {out / 'soak.png'} "
          f"({result['total_wall_seconds']:.0f} s)")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
