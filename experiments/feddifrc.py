"""FedDifRC table: `python -m experiments feddifrc [--dataset mnist-5k] [--seeds 0,1,2] [--splits ...] [--methods ...]`.

10 clients, Dirichlet alpha in {0.05, 0.1, 0.5} and a pathological split (2 classes per client; `a0.2` on request);
31 rounds x 2 local epochs by default, where FedAvg converged at alpha 0.5 (experiments.feddifrc_budget);
FedAvg, FedProx, MOON, FedDifRC with TDCL only, with NDCR only, and with both; per round Flower's
FedAvg samples `--fraction-train` of the clients (the paper: 5 of 10). A cell is the mean over the
last 5 rounds of the global test accuracy, mean ± std over seeds. The ablation rows (`--methods
feddifrc-l2,...`) flip one of FedDifRC's documented choices each. Writes <out>/<stem>.json (every
curve) and <out>/<stem>_rounds.png (accuracy per round), stem = feddifrc (digits) or
feddifrc_<dataset>; --out defaults to docs/results. With --doc PAGE.md the main rows, seed by seed, replace
the page's generated block `feddifrc:<stem>-<rounds>x<local-epochs>` (experiments.common.write_block);
`--seeds ""` runs nothing and rewrites the json's views only.

Backends. `--backend ray` runs every cell through `fedapp.simulate` (Flower's Ray simulation).
`--backend inprocess` (default) runs it through `fedapp.simulation.simulate_in_process`: only the
transport differs (an InProcessGrid hands each message to the ClientApp's handler on a per-node Flower
Context whose state persists across rounds, one client after another); the server side is the same
`fedapp.server_app.run_server` (strategy, Flower's FedAvg loop and aggregation, validation, metering).
It saves Ray's start-up (~15 s a run) and lets the diffusion features be shared by the three FedDifRC
rows of a cell (clients.feddifrc.SHARE_TARGETS: with the shared public basis, targets per image and prompt).

Beside each cell (experiments.common): its convergence verdict (every seed's curve: the last-5-round mean
at round R against at round R-10, |delta| < 1 point; the cell is converged only if every seed is), the
same-seed difference against FedAvg ("+1.2 ± 0.8 (3/3)": mean ± std over the seeds both rows have, and how
many favour the row), and the compute: optimiser steps and images seen, summed over the clients and rounds
of a run (a train reply = local-epochs passes over the client's n_k images in ceil(n_k / batch-size)
minibatches; which clients trained how often is read from the run's message counts, n_k from the config's
partition), mean over seeds. `fraction-evaluate = 0`: the table reads only the server's global test
accuracy (metrics.jsonl's `accuracy`, strategies.fedavg global_evaluate), so no client evaluates.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from experiments.cli import common_args, pin_threads
from experiments.common import (BACKENDS, accuracy_curve, all_converged, check_configs, classification_verdict,
                                count_text, file_lock, merge_results, paired_difference, paired_text, parse_set, prog,
                                quiet_logs, results_on_disk, run, subset_of, verdict_mark, write_block)
from fedapp.results import atomic_write_json

SPLITS = {
    "a0.05": {"partitioner": "dirichlet", "partitioner.alpha": 0.05},
    "a0.1": {"partitioner": "dirichlet", "partitioner.alpha": 0.1},
    "a0.2": {"partitioner": "dirichlet", "partitioner.alpha": 0.2},
    "a0.5": {"partitioner": "dirichlet", "partitioner.alpha": 0.5},
    "path": {"partitioner": "pathological", "partitioner.classes-per-client": 2},
}
METHODS = {
    "fedavg": ("FedAvg", {"method": "fedavg"}),
    "fedprox": ("FedProx", {"method": "fedprox"}),
    "moon": ("MOON", {"method": "moon"}),
    "tdcl": ("+TDCL only", {"method": "feddifrc", "feddifrc.lambda-ndcr": 0.0}),
    "ndcr": ("+NDCR only", {"method": "feddifrc", "feddifrc.lambda-tdcl": 0.0}),
    "feddifrc": ("FedDifRC", {"method": "feddifrc"}),
    # ablations, not run by default: each flips one documented choice of FedDifRC (docs/feddifrc.md)
    "feddifrc-l2": ("FedDifRC, NDCR on raw vectors", {"method": "feddifrc", "feddifrc.ndcr-form": "l2"}),
    "ndcr-l2": ("+NDCR only, raw vectors", {"method": "feddifrc", "feddifrc.lambda-tdcl": 0.0,
                                            "feddifrc.ndcr-form": "l2"}),
    "feddifrc-nl2": ("FedDifRC, NDCR as the paper's L2 on unit vectors",
                     {"method": "feddifrc", "feddifrc.ndcr-form": "normalized-l2"}),
    "feddifrc-head": ("FedDifRC, on a projection head", {"method": "feddifrc", "feddifrc.feature-on": "head"}),
    "feddifrc-mean": ("FedDifRC, mean pooling", {"method": "feddifrc", "feddifrc.pool": "mean"}),
    "feddifrc-client-pca": ("FedDifRC, PCA per client", {"method": "feddifrc", "feddifrc.pca-fit": "client"}),
    "feddifrc-tau0.5": ("FedDifRC, tau 0.5", {"method": "feddifrc", "feddifrc.tau": 0.5}),
    "feddifrc-dynamic": ("FedDifRC, dynamic condition", {"method": "feddifrc", "feddifrc.dynamic-condition": 0.5}),
    # the remaining differences from the paper and the official code, one row each
    "feddifrc-t261": ("FedDifRC, t 261 (official code)", {"method": "feddifrc", "feddifrc.t": 261}),
    "feddifrc-lambda0.1": ("FedDifRC, both weights 0.1", {"method": "feddifrc", "feddifrc.lambda-tdcl": 0.1,
                                                         "feddifrc.lambda-ndcr": 0.1}),
    "feddifrc-blocks12": ("FedDifRC, up-blocks 1,2 only", {"method": "feddifrc", "feddifrc.up-blocks": "1,2"}),
}
DEFAULT_METHODS = ("fedavg", "fedprox", "moon", "tdcl", "ndcr", "feddifrc")
# each ablation row is also read against the default row whose one choice it flips, same seeds
ABLATION_OF = {m: ("ndcr" if m.startswith("ndcr") else "feddifrc") for m in METHODS if m not in DEFAULT_METHODS}
SPLIT_NAMES = {"a0.05": "α = 0.05", "a0.1": "α = 0.1", "a0.2": "α = 0.2", "a0.5": "α = 0.5",
               "path": "two classes a client"}
DEFAULT_SPLITS = ("a0.05", "a0.1", "a0.5", "path")  # alpha 0.05, 0.1, 0.5 and 2 classes per client
# The paper's CIFAR-10 table (ResNet-10, SD-2.1, 10 clients, 50 rounds): NID1 = Dirichlet alpha, NID2 = pathological.
PAPER = {
    "FedAvg": {"a0.05": 78.27, "a0.2": 84.65, "a0.5": 86.11, "path": 72.60},
    "FedProx": {"a0.05": 78.42, "a0.2": 84.59, "path": 72.81},
    "MOON": {"a0.05": 80.79, "a0.2": 86.10, "path": 73.35},
    "+TDCL only": {"a0.05": 81.39, "a0.2": 86.03, "a0.5": 88.16, "path": 75.67},
    "+NDCR only": {"a0.05": 80.35, "a0.2": 86.40, "a0.5": 87.54, "path": 75.33},
    "FedDifRC": {"a0.05": 83.14, "a0.2": 88.27, "a0.5": 89.31, "path": 76.45},
}
LAST = 5  # the cell: mean accuracy of the last 5 rounds
BASELINE = "fedavg"  # the paper's main baseline: every row's same-seed difference is against it
FRACTION_EVALUATE = 0.0  # only the server's global test accuracy is read: no client evaluates


def uses_prior(method: str) -> bool:
    return METHODS[method][1]["method"] == "feddifrc"


def cell_config(a: argparse.Namespace, seed: int, split: str, method: str) -> dict[str, Any]:
    return {"dataset": a.dataset, "num-server-rounds": a.rounds, "local-epochs": a.local_epochs, "lr": a.lr,
            "fraction-train": a.fraction_train, "fraction-evaluate": FRACTION_EVALUATE,
            "batch-size": a.batch_size, "seed": seed, "prior": a.prior, "min-clients": 2, "partitioner.per-class": 0,
            "device": "cpu", "out-dir": a.runs_dir, "run-name": f"{method}-{split}-s{seed}", **parse_set(a.set),
            **SPLITS[split], **METHODS[method][1]}


def cell_stats(curves: list[list[float]]) -> tuple[float, float]:
    """(mean, std over seeds) of each seed's mean accuracy over the last LAST rounds, in %."""
    per_seed = [last_mean(c) for c in curves]
    return float(np.mean(per_seed)), float(np.std(per_seed))


def last_mean(curve: list[float]) -> float:
    """A seed's figure: its mean accuracy over the last LAST rounds, in %."""
    return 100 * float(np.mean(curve[-LAST:]))


DIP_BAR = 0.90  # a round reading below this after the model has learned is a dip (as on the path split's curves)


def second_half(curve: list[float]) -> dict[str, float | int]:
    """A seed's stability once it has learned: the median round (%) and the number of rounds below DIP_BAR
    over the second half of its rounds. Where single rounds swing by points (two classes per client, 5 of 10
    clients sampled) the last-LAST mean carries one dip's noise; this reading is descriptive, fixed after
    seeing those curves, and sits beside the table's rule, not in place of it."""
    half = np.asarray(curve[len(curve) // 2:], dtype=float)
    return {"median": 100 * float(np.median(half)), "rounds_below": int((half < DIP_BAR).sum())}


def shard_sizes(flat: dict[str, Any], clients: int) -> list[int]:
    """n_k: each client's training images under the run config (a shard is a pure function of it)."""
    from fedapp.config import parse_run_config
    from fedapp.data import client_shard

    cfg = parse_run_config(flat)
    return [len(client_shard(cfg, k, clients).train) for k in range(clients)]


def run_compute(flat: dict[str, Any], summary: dict[str, Any], sizes: list[int]) -> dict[str, int] | None:
    """Optimiser steps and images seen by a run, summed over clients: each train reply is local-epochs
    passes over n_k images in ceil(n_k / batch-size) minibatches (clients.classify.local_train). The replies
    a client sent are its messages up in the run's comm ledger: train replies only at fraction-evaluate = 0,
    train plus one evaluate reply a round at 1; None for any other fraction (the split is not recorded)."""
    from fedapp.config import parse_run_config

    cfg = parse_run_config(flat)
    if cfg.fraction_evaluate not in (0.0, 1.0):
        return None
    evaluated = cfg.num_server_rounds if cfg.fraction_evaluate == 1.0 else 0
    per = summary["comm"]["per_client"]
    trained = {k: max(per[str(k)]["messages_up"] - evaluated, 0) for k in range(len(sizes)) if str(k) in per}
    return {"steps": sum(t * cfg.local_epochs * math.ceil(sizes[k] / cfg.batch_size) for k, t in trained.items()),
            "images_seen": sum(t * cfg.local_epochs * sizes[k] for k, t in trained.items())}


def paired_on(reading: Callable[[list[float]], float], runs: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """The same-seed difference of one reading of each seed's curve (higher is better) between two cells' runs."""
    return paired_difference({k: reading(r["curve"]) for k, r in runs.items()},
                             {k: reading(r["curve"]) for k, r in other.items()}, higher_is_better=True)


def half_median(curve: list[float]) -> float:
    return second_half(curve)["median"]


def cell_summary(results: dict[str, Any], split: str, method: str) -> dict[str, Any] | None:
    """One cell's figures beside its mean: the verdict over its seeds, the same-seed difference of the
    last-LAST-rounds accuracy against BASELINE (points; None for the baseline itself or without it), and
    the mean steps / images seen over the seeds that report them (None before they were recorded)."""
    runs = results.get(split, {}).get(method, {})
    if not runs:
        return None
    base = results.get(split, {}).get(BASELINE, {}) if method != BASELINE else {}
    out = {"verdict": all_converged([classification_verdict(r["curve"]) for r in runs.values()]),
           f"vs_{BASELINE}": paired_on(last_mean, runs, base) if base else None}
    row = results.get(split, {}).get(ABLATION_OF.get(method, ""), {})
    if row:  # an ablation against its default row
        out[f"vs_{ABLATION_OF[method]}"] = paired_on(last_mean, runs, row)
    for key in ("steps", "images_seen"):
        vals = [r[key] for r in runs.values() if r.get(key) is not None]
        out[key] = float(np.mean(vals)) if vals else None
    out["second_half"] = {k: second_half(r["curve"]) for k, r in runs.items()}
    if base:
        out[f"second_half_median_vs_{BASELINE}"] = paired_on(half_median, runs, base)
    return out


def cells(results: dict[str, Any], splits: list[str], methods: list[str]) -> dict[str, dict[str, Any]]:
    """cell_summary of every measured cell, as the json keeps them: {split: {method: ...}}."""
    return {s: {m: c for m in methods if (c := cell_summary(results, s, m)) is not None} for s in splits}


def accuracy_cell(results: dict[str, Any], split: str, method: str, summary: dict[str, Any] | None) -> str:
    curves = [v["curve"] for v in results.get(split, {}).get(method, {}).values()]
    if not curves:
        return "—"
    mu, sd = cell_stats(curves)
    mark = verdict_mark(summary["verdict"])
    return f"{mu:.2f} ± {sd:.2f} (n={len(curves)})" + (f" {mark}" if mark else "")


def table_text(results: dict[str, Any], splits: list[str], methods: list[str]) -> str:
    """The accuracy grid (methods x splits, "not converged" beside such cells), then per cell the
    same-seed difference against FedAvg and the compute."""
    summaries = cells(results, splits, methods)
    lines = ["| method | " + " | ".join(splits) + " |", "|" + "---|" * (len(splits) + 1)]
    for m in methods:
        row = [accuracy_cell(results, s, m, summaries[s].get(m)) for s in splits]
        lines.append(f"| {METHODS[m][0]} | " + " | ".join(row) + " |")
    ablations = any(m in ABLATION_OF for m in methods)
    lines += ["", f"| method | split | vs {METHODS[BASELINE][0]}, same seeds (points) |"
              + (" vs the default row it flips |" if ablations else "") + " steps | images seen |",
              "|---|---|---|" + ("---|" if ablations else "") + "---|---|"]
    for m in methods:
        for s in splits:
            c = summaries[s].get(m)
            if c is not None:
                vs = "—" if m == BASELINE else paired_text(c[f"vs_{BASELINE}"])
                if ablations:
                    ref = ABLATION_OF.get(m)
                    vs += f" | {METHODS[ref][0]}: {paired_text(c[f'vs_{ref}'])}" if f"vs_{ref}" in c else " | —"
                lines.append(f"| {METHODS[m][0]} | {s} | {vs} | {count_text(c['steps'])} | "
                             f"{count_text(c['images_seen'])} |")
    return "\n".join(lines)


def seed_table(results: dict[str, Any], split: str, methods: list[str], budget: str) -> str:
    """One split's cells seed by seed, as a method's page shows them (--doc): each seed's last-LAST mean and
    their mean ± std, the same-seed difference against BASELINE with each seed's, the same for the
    second-half median (second_half), and how many seeds converged."""
    summaries = cells(results, [split], methods)[split]
    seeds = sorted({k for m in methods for k in results.get(split, {}).get(m, {})}, key=int)
    base = METHODS[BASELINE][0]
    lines = [f"| {SPLIT_NAMES[split]}, {budget} | last-{LAST} mean (seeds {' / '.join(seeds)}) | − {base}, same "
             f"seeds | second-half median − {base} | converged |", "|---|---|---|---|---|"]
    for m in methods:
        c = summaries.get(m)
        if c is None:
            continue
        runs = results[split][m]
        mu, sd = cell_stats([r["curve"] for r in runs.values()])
        each = " / ".join(f"{last_mean(runs[k]['curve']):.2f}" if k in runs else "—" for k in seeds)
        vs = half = "—"
        p = c[f"vs_{BASELINE}"]
        if p:  # a row beside the baseline, on the seeds both have
            vs = f"{paired_text(p)}; per seed " + " / ".join(f"{p['per_seed'][k]:+.2f}" for k in sorted(
                p["per_seed"], key=int))
            half = paired_text(c[f"second_half_median_vs_{BASELINE}"])
        v = c["verdict"]
        lines.append(f"| {METHODS[m][0]} | {mu:.2f} ± {sd:.2f} ({each}) | {vs} | {half} | "
                     f"{v['converged_seeds']} of {v['seeds']} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], splits: list[str], methods: list[str], path: Path, dataset: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(splits), figsize=(4.2 * len(splits), 3.4), squeeze=False)
    for ax, s in zip(axes[0], splits):
        for m in methods:
            curves = [v["curve"] for v in results.get(s, {}).get(m, {}).values()]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            arr = 100 * np.array([c[:n] for c in curves])
            x = np.arange(1, n + 1)
            mark = verdict_mark(all_converged([classification_verdict(c) for c in curves]))
            ax.plot(x, arr.mean(0), label=METHODS[m][0] + (f" ({mark})" if mark else ""))
            ax.fill_between(x, arr.mean(0) - arr.std(0), arr.mean(0) + arr.std(0), alpha=0.15)
        ax.set_title(f"{dataset}, {s}")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)  # on every panel: the verdicts are per split
    axes[0][0].set_ylabel("global test accuracy (%)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_shared_targets(path: Path) -> None:
    """Targets an earlier process of the table computed (clients.feddifrc._SHARED): with the shared basis
    they depend on neither client nor seed, and recomputing them costs 11 UNet passes per image."""
    import torch

    import clients.feddifrc as fdr

    if path.is_file():
        fdr._SHARED.update(torch.load(path, weights_only=False))


def save_shared_targets(path: Path) -> None:
    import os

    import torch

    import clients.feddifrc as fdr

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(fdr._SHARED, tmp)
    os.replace(tmp, path)


def write_table(path: Path, setup: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """The json: every run's curve (and verdict, compute), and per cell its verdict, the same-seed difference
    against FedAvg and the mean compute (cell_summary). Rows another runner wrote meanwhile (same setup) are
    merged in, under a lock; returns the merged results."""
    with file_lock(path):
        results = merge_results(results, results_on_disk(path, setup))
        splits = [s for s in SPLITS if s in results]
        atomic_write_json(path, {"setup": setup, "paper_cifar10": PAPER, "results": results,
                                 "cells": cells(results, splits, list(METHODS))})
    return results


def parser() -> argparse.ArgumentParser:
    shared = common_args(dataset="mnist-5k", seeds="0,1,2", set=[], out="docs/results", runs_dir="runs/feddifrc-table",
                         threads=1, helps={"set": "run-config overrides, e.g. feddifrc.up-blocks=0,1",
                                           "out": "folder for <stem>.json and <stem>_rounds.png",
                                           "threads": "torch threads (the machine is shared)"})
    p = argparse.ArgumentParser(prog=prog("feddifrc"), description=__doc__.split("\n")[0], parents=[shared])
    p.add_argument("--splits", default=",".join(DEFAULT_SPLITS), help=f"subset of {','.join(SPLITS)}")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--rounds", type=int, default=31,
                   help="docs/results/feddifrc_budget.json: FedAvg converged at 31 x 2")
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--fraction-train", type=float, default=0.5, help="clients sampled per round (paper: 5 of 10)")
    p.add_argument("--prior", default="tiny",
                   help="the frozen prior FedDifRC reads (default: the dataset's tiny prior)")
    p.add_argument("--backend", choices=BACKENDS, default="inprocess")
    p.add_argument("--fresh", action="store_true", help="ignore cells already in <out>/feddifrc.json")
    p.add_argument("--doc", default=None, metavar="PAGE.md",
                   help="write the main rows, seed by seed, into this page's generated block")
    return p


def table_setup(a: argparse.Namespace) -> dict[str, Any]:
    """What every cell of the json depends on: a rerun under the same setup resumes its cells."""
    setup = {"dataset": a.dataset, "clients": a.clients, "rounds": a.rounds, "local_epochs": a.local_epochs,
             "lr": a.lr, "batch_size": a.batch_size, "backend": a.backend, "last_rounds": LAST,
             "fraction_evaluate": FRACTION_EVALUATE}
    if a.fraction_train != 1.0:  # only when not 1, so that tables measured before client sampling still resume
        setup["fraction_train"] = a.fraction_train
    if a.set:  # only when given, so that tables measured before --set existed still resume
        setup["set"] = parse_set(a.set)
    return setup


def main(argv: list[str]) -> None:
    a = parser().parse_args(argv)
    pin_threads(a.threads)
    import clients.feddifrc as fdr

    quiet_logs()
    fdr.share_targets(a.backend == "inprocess")
    shared_path = Path(a.runs_dir) / "shared-targets.pt"
    if fdr.SHARE_TARGETS:
        load_shared_targets(shared_path)
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]  # none: only the views are rewritten
    splits, methods = subset_of("splits", a.splits, SPLITS), subset_of("methods", a.methods, METHODS)
    check_configs([cell_config(a, seed, s, m) for seed in seeds[:1] for s in splits for m in methods], a.clients)
    out = Path(a.out)
    stem = "feddifrc" if a.dataset == "digits" else f"feddifrc_{a.dataset}"
    json_path, png_path = out / f"{stem}.json", out / f"{stem}_rounds.png"
    setup = table_setup(a)
    # resume: keep the cells already measured under the same setup
    results: dict[str, Any] = {} if a.fresh else results_on_disk(json_path, setup)
    t_all = time.time()
    for seed in seeds:  # seed-major: a seed's splits share one noise draw, so raw features are reused
        for s in splits:
            for m in methods:
                done = results.get(s, {}).get(m, {}).get(str(seed))
                if done is not None and (not uses_prior(m) or done.get("prior") == a.prior):
                    continue  # measured under this setup (and, for FedDifRC rows, with this prior)
                t0 = time.time()
                flat = cell_config(a, seed, s, m)
                summary = run(flat, a.clients, a.backend)
                row = {"curve": accuracy_curve(summary), "seconds": round(time.time() - t0, 1),
                       "failures": len(summary.get("failures", []))}
                row["verdict"] = classification_verdict(row["curve"])
                row.update(run_compute(flat, summary, shard_sizes(flat, a.clients)) or {})
                if uses_prior(m):
                    row["prior"] = a.prior
                    if fdr.SHARE_TARGETS:
                        save_shared_targets(shared_path)
                for k in ("representation_cache_bytes_total", "feature_seconds_total"):
                    if k in summary["metrics"]:
                        row[k] = summary["metrics"][k]
                results.setdefault(s, {}).setdefault(m, {})[str(seed)] = row
                print(f"[{time.time() - t_all:6.0f}s] seed {seed} {s:5s} {METHODS[m][0]:11s} "
                      f"last-{LAST} {last_mean(row['curve']):.2f}%  ({row['seconds']} s)", flush=True)
                results = write_table(json_path, setup, results)
    if not results:
        raise SystemExit(f"{json_path}: no cells measured under this setup (--rounds {a.rounds}, --local-epochs "
                         f"{a.local_epochs}, ...); give --seeds to run some")
    results = write_table(json_path, setup, results)  # a resumed table gets its cells' summaries too
    all_splits = [s for s in SPLITS if s in results]
    present = [m for m in METHODS if any(m in results[s] for s in all_splits)]
    main_rows = [m for m in present if m in DEFAULT_METHODS]
    print(f"\n{a.dataset}, {a.clients} clients ({a.fraction_train:g} per round), {a.rounds} rounds x "
          f"{a.local_epochs} local epochs; "
          f"mean of the last {LAST} rounds' global test accuracy (%), mean ± std over seeds; not converged: "
          f"a seed's last-{LAST} mean moved >= 1 point over the last 10 rounds (or it has < 15 rounds)\n"
          f"{table_text(results, all_splits, main_rows)}")
    extra = [m for m in present if m not in DEFAULT_METHODS]
    if extra:
        print(f"\nablations (one choice flipped each)\n{table_text(results, all_splits, extra)}")
    plot(results, all_splits, main_rows, png_path, a.dataset)
    print(f"wrote {json_path} and {png_path} ({time.time() - t_all:.0f} s)")
    if a.doc:
        budget = f"{a.rounds} rounds × {a.local_epochs} local epochs"
        write_block(Path(a.doc), f"feddifrc:{stem}-{a.rounds}x{a.local_epochs}",
                    "\n\n".join(seed_table(results, s, main_rows, budget) for s in all_splits))
        print(f"wrote its seed-by-seed table into {a.doc}")
