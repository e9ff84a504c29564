"""`python -m experiments feddifrc-budget`: the FedAvg budget at which FedDifRC's table is read.

FedAvg on mnist-5k (28 px, 10 clients, 5 sampled a round, Dirichlet alpha 0.5 or --split; the classifier recipe of
docs/recipe.md; lr 0.02, batch 16; fraction-evaluate 0: the server's global test accuracy) for each of
--local-epochs, --rounds rounds, over --seeds. At every round R, the convergence verdict of each seed's curve
up to R (experiments.common.classification_verdict: the last-5-round mean at R against at R - 10, < 1 point).
The budget of a local-epochs setting is the first R at which every seed's curve is converged; the table's
budget is the cheapest of them in client epochs (R x local epochs). In-process runs
(fedapp.simulation.simulate_in_process). Writes <out>/feddifrc_budget.json and .png (alpha 0.5, the table's
budget), or <out>/feddifrc_budget_<split>.json and .png for another split: whether the budget reaches it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.cli import common_args, pin_threads
from experiments.common import (accuracy_curve, check_configs, classification_verdict, paired_difference, paired_text,
                                prog, quiet_logs, run)
from experiments.feddifrc import METHODS, SPLITS
from fedapp.results import atomic_write_json

CLIENTS = 10


def config(local_epochs: int, rounds: int, seed: int, runs: str, split: str = "a0.5") -> dict[str, Any]:
    return {**METHODS["fedavg"][1], **SPLITS[split], "dataset": "mnist-5k", "num-server-rounds": rounds,
            "local-epochs": local_epochs, "lr": 0.02, "batch-size": 16, "fraction-train": 0.5,
            "fraction-evaluate": 0.0, "partitioner.per-class": 0, "min-clients": 2, "seed": seed, "device": "cpu",
            "out-dir": runs, "run-name": f"fedavg-{split}-e{local_epochs}-r{rounds}-s{seed}"}


def converged_at(curves: list[list[float]]) -> int | None:
    """The first round R at which every seed's curve up to R is converged (None: not within the curves)."""
    for r in range(1, min(map(len, curves)) + 1):
        if all(classification_verdict(c[:r])["converged"] for c in curves):
            return r
    return None


def summary(results: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Per local-epochs setting: where it converged, the accuracy there (mean ± std over seeds), its cost in
    client epochs, and its same-seed difference against the fewest local epochs measured at the last round
    (points; experiments.common.paired_difference); and the cheapest converged setting, the table's budget."""
    fewest = min(results, key=int, default=None)
    rows = {}
    for e, per_seed in results.items():
        curves = list(per_seed.values())
        r = converged_at(curves)
        at = [c[r - 1] for c in curves] if r else [c[-1] for c in curves]
        rows[e] = {"converged_at_round": r, "rounds_run": min(map(len, curves)), "seeds": len(curves),
                   "accuracy_mean": float(np.mean(at)), "accuracy_std": float(np.std(at)),
                   "client_epochs": r * int(e) if r else None}
        if e != fewest:
            rows[e][f"last_round_vs_{fewest}_local_epochs"] = paired_difference(
                {k: 100 * c[-1] for k, c in per_seed.items()},
                {k: 100 * c[-1] for k, c in results[fewest].items()}, higher_is_better=True)
    done = {e: v for e, v in rows.items() if v["converged_at_round"]}
    best = min(done, key=lambda e: done[e]["client_epochs"]) if done else None
    budget = {"local_epochs": int(best), "rounds": done[best]["converged_at_round"]} if best else None
    return {"by_local_epochs": rows, "budget": budget}


def table_text(s: dict[str, Any]) -> str:
    lines = ["| local epochs | rounds run | converged at round | accuracy there (%) | client epochs (R × E) | "
             "last round − fewest local epochs, same seeds (points) |", "|---|---|---|---|---|---|"]
    for e, v in s["by_local_epochs"].items():
        r = v["converged_at_round"]
        vs = next((paired_text(p) for k, p in v.items() if k.startswith("last_round_vs_")), "—")
        lines.append(f"| {e} | {v['rounds_run']} | {r or 'not converged'} | {100 * v['accuracy_mean']:.1f} ± "
                     f"{100 * v['accuracy_std']:.1f} | {v['client_epochs'] or '—'} | {vs} |")
    b = s["budget"]
    lines.append("" if not b else f"\nbudget: {b['rounds']} rounds × {b['local_epochs']} local epochs")
    return "\n".join(lines)


def stem(split: str) -> str:
    """feddifrc_budget (alpha 0.5, the table's budget) or feddifrc_budget_<split>."""
    return "feddifrc_budget" if split == "a0.5" else f"feddifrc_budget_{split}"


def plot(results: dict[str, dict[str, list[float]]], s: dict[str, Any], path: Path, split: str = "a0.5") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for e, per_seed in results.items():
        n = min(map(len, per_seed.values()))
        arr = 100 * np.array([c[:n] for c in per_seed.values()])
        x = np.arange(1, n + 1)
        line, = ax.plot(x, arr.mean(0), label=f"{e} local epochs ({len(per_seed)} seeds)")
        ax.fill_between(x, arr.mean(0) - arr.std(0), arr.mean(0) + arr.std(0), alpha=0.2, color=line.get_color())
        r = s["by_local_epochs"][e]["converged_at_round"]
        if r:
            ax.axvline(r, color=line.get_color(), ls=":", lw=1)
    ax.set(xlabel="round", ylabel="server test accuracy (%)", ylim=(40, 100),
           title=f"FedAvg, mnist-5k, {split}, 5 of 10 clients a round\n(dotted: converged on every seed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> None:
    shared = common_args(seeds="0,1,2", out="docs/results", runs="runs/feddifrc-budget", threads=2,
                         helps={"threads": "torch threads (one job at a time)"})
    p = argparse.ArgumentParser(prog=prog("feddifrc-budget"), description=__doc__.split("\n")[0], parents=[shared])
    p.add_argument("--local-epochs", default="2,5", help="comma-separated settings to measure")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--split", default="a0.5", choices=list(SPLITS),
                   help="the partition measured (a0.5: the table's budget; others: where that budget converges)")
    a = p.parse_args(argv)
    pin_threads(a.threads)
    quiet_logs()
    seeds = [int(s) for s in a.seeds.split(",")]
    epochs = [int(e) for e in a.local_epochs.split(",")]
    check_configs([config(e, a.rounds, seeds[0], a.runs, a.split) for e in epochs], CLIENTS)
    out = Path(a.out)
    json_path, png_path = out / f"{stem(a.split)}.json", out / f"{stem(a.split)}.png"
    results: dict[str, dict[str, list[float]]] = {}
    if json_path.exists():
        old = json.loads(json_path.read_text())
        if old.get("rounds") == a.rounds:  # resume: runs of the same length
            results = old["results"]
    for e in epochs:
        for seed in seeds:
            cell = results.setdefault(str(e), {})
            if str(seed) in cell:
                continue
            t = time.time()
            cell[str(seed)] = accuracy_curve(run(config(e, a.rounds, seed, a.runs, a.split), CLIENTS, "inprocess"))
            print(f"{e} local epochs, seed {seed}: last {100 * cell[str(seed)][-1]:.1f} % "
                  f"({time.time() - t:.0f} s)", flush=True)
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(json_path, {"rounds": a.rounds, "results": results, "summary": summary(results)})
    s = summary(results)
    atomic_write_json(json_path, {"rounds": a.rounds, "results": results, "summary": s})
    plot(results, s, png_path, a.split)
    print(table_text(s))
    print(f"wrote {json_path} and {png_path}")
