"""One leaderboard: every method on the same clients, accuracy against bytes uploaded and time.

    python -m experiments leaderboard --dataset mnist-styles --partitioner domain --seeds 0,1,2
    python -m experiments leaderboard --dataset mnist-5k --partitioner dirichlet --alpha 0.1 --seeds 0,1,2

Every entry (ENTRIES) is a run config of the real method, one-shot and multi-round side by side, at the
budget its own table found converged (SETTINGS), on the same partition and test set: a client's shard is a
pure function of the data keys and the seed, which every entry of a seed shares. Per cell (entry, seed), from
the run's summary.json and comm.json:

- global test accuracy, and the clients' accuracy on their own real test splits (mean and std over clients;
  the FedAvg family asks its clients once, in the last round: `evaluate-every` = `num-server-rounds`);
- bytes up and down per client, mean over clients: the method's own, without the final federated
  evaluation's (a model down and an accuracy up, the same for every entry) and without the built-in prior's
  shipment, a one-off per node reported in its own column (the prior's record bytes);
- rounds (one-shot methods 1, the centralised oracle 0: it uploads nothing);
- client compute seconds per client (each reply's own wall time, fedapp.protocols.SECONDS_KEY, evaluation
  left out), the server's seconds (the run's wall time less all client compute: in-process the clients run
  one after another inside the run) and the wall time.

Priors are built (or found in the cache) before any cell runs, so no cell's time holds a one-off build.
A multi-round cell's convergence verdict (experiments.common.classification_verdict) is kept beside it.

Resumable: a finished cell's figures are kept in <out>/cells/, named by a digest of its whole run config
(but out-dir); adding an entry or a seed runs only the new cells. Writes <out>/leaderboard_<setting>.json,
<out>/leaderboard_<setting>.png (accuracy against upload bytes, log scale, and against wall time, mean ± std
over seeds both ways, the Pareto front marked) and the setting's table into docs/leaderboard.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import statistics
from pathlib import Path
from typing import Any

from experiments.cli import common_args, pin_threads
from experiments.common import (accuracy_curve, check_configs, classification_verdict, config_errors_exit,
                                paired_difference, paired_text, parse_set, prog, quiet_logs, run, subset_of,
                                write_block)
from fedapp.audit.membership import strongest
from fedapp.results import atomic_write_json, save_png

# name -> run-config keys; the partition, seed and the setting's budgets come from SETTINGS
ENTRIES = {
    "Espresso": {"method": "espresso"},  # the default run's settings
    # the paper's setting as Espresso's own table runs it: Z-sampling at 25 steps (>= 5 zigzags)
    "Espresso (paper)": {"method": "espresso", "espresso.steps": 25},
    "Prompts-only": {"method": "prompts"},
    "class-embed": {"method": "class-embed"},
    "FedAvg": {"method": "fedavg"},
    "FedProx": {"method": "fedprox"},
    "MOON": {"method": "moon"},
    "FedDifRC": {"method": "feddifrc"},
    "Centralised": {"method": "centralized"},  # ORACLE: the union of the clients' real shards
}
ORACLES = ("Centralised",)  # a reference line in the plots, never on a Pareto front (it uploads nothing)
BASELINE = "FedAvg"  # every entry's same-seed accuracy difference is against it
# partitioner -> the clients, data keys and the multi-round budget its own table found converged
SETTINGS = {
    # Espresso's tables (docs/espresso.md): 4 clients, one style each, 16 images a class; FedAvg reference
    # 30 rounds (espresso-ablation --fedavg-rounds). The prior is the latent tiny-sd of every style (Espresso's
    # defaults on the pixel `tiny` prior of mnist-styles reached 34.8 % global accuracy, seed 0),
    # and every entry reads the same 32 px images: image-size pinned, not the dataset's native 28 px.
    "domain": {"clients": 4, "data": {"partitioner.name": "domain", "partitioner.per-class": 16,
                                      "prior": "tiny-sd", "image-size": 32},
               "rounds": {"num-server-rounds": 30}},
    # FedDifRC's tables (docs/feddifrc.md): 10 clients, 5 a round; alpha 0.1 converges at 80 rounds x 2 local
    # epochs (alpha 0.05 needs 160: pass --set num-server-rounds=160). The prior is mnist-5k's latent tiny-sd
    # at 32 px, as in FedDifRC's prior row (FedAvg 97.9 %, 3 of 3 converged there): the pixel tiny prior draws
    # the prompted digit 34 % of the time (docs/priors.md), which the one-shot entries would inherit.
    "dirichlet": {"clients": 10, "data": {"partitioner.name": "dirichlet", "partitioner.per-class": 0,
                                          "prior": "tiny-sd", "image-size": 32},
                  "rounds": {"num-server-rounds": 80, "local-epochs": 2, "fraction-train": 0.5}},
}
EVALUATE = "evaluate"  # the federated evaluation's message type (fedapp.protocols.classify.EVALUATE)
PRIOR = "query.prior"  # the built-in prior's shipment (fedapp.protocols.espresso.PRIOR): once per node, ever
# methods whose clients read the prior but load it from their own disk (a deployed node builds or copies it,
# docs/feddifrc.md): nothing ships, yet each client holds it as an Espresso client does
CLIENTS_LOAD_PRIOR = ("feddifrc",)


def round_based(method: str) -> bool:
    """A method on Flower's FedAvg round loop (it samples clients, has rounds and a per-round curve)."""
    from fedapp import registry

    return registry.METHODS[method].samples_clients


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise SystemExit(f"--seeds={text}: must be comma-separated whole numbers, e.g. 0,1,2") from None
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise SystemExit(f"--seeds={text}: must be distinct and non-negative")
    return seeds


def setting_name(a: argparse.Namespace) -> str:
    alpha = f"-a{a.alpha:g}" if a.partitioner == "dirichlet" else ""
    return f"{a.dataset}-{a.partitioner}{alpha}"


def cell_config(a: argparse.Namespace, entry: str, seed: int) -> dict[str, Any]:
    """One cell's run config: the setting's partition and seed, the entry's method at its budget."""
    setting = SETTINGS[a.partitioner]
    flat = {"dataset": a.dataset, **setting["data"], "seed": seed, "min-clients": setting["clients"],
            "device": "cpu", "out-dir": str(Path(a.runs) / setting_name(a)),  # both settings share one --runs
            "run-name": f"{slug(entry)}-s{seed}", **ENTRIES[entry],
            "log.uploads": True}  # what each client sent, for the privacy audit (no figure depends on it)
    if a.partitioner == "dirichlet":
        flat["partitioner.alpha"] = a.alpha
    if round_based(flat["method"]):
        flat.update(setting["rounds"])
        flat["fraction-evaluate"] = 1.0
    overrides = parse_set(a.set)
    flat.update(overrides)
    if round_based(flat["method"]):
        from fedapp.config import all_defaults

        defaults = all_defaults()
        flat["evaluate-every"] = flat.get("num-server-rounds", defaults["num-server-rounds"])  # once, at the end
        if "min-clients" not in overrides:  # Flower's FedAvg samples at least min-clients: a round's share, so
            # that fraction-train applies (min-clients = all 10 made the first Dirichlet cells train 10 a round)
            flat["min-clients"] = max(1, int(setting["clients"] * flat.get("fraction-train",
                                                                            defaults["fraction-train"])))
    return flat


def slug(entry: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in entry.lower()).strip("-").replace("--", "-")


NOT_DIGESTED = ("out-dir", "log.uploads")  # keys that move no figure: a cell run with or without them is the same


def cell_file(cells: Path, flat: dict[str, Any]) -> Path:
    from fedapp.models.cache import facts_digest

    digest = facts_digest({k: v for k, v in flat.items() if k not in NOT_DIGESTED})
    return cells / f"{flat['run-name']}-{digest}.json"


def phase_cost(comm: dict[str, Any], phase: str) -> dict[str, float]:
    """One phase's bytes and client seconds, summed over nodes (comm.json's by_phase)."""
    rows = [phases[phase] for phases in comm.get("by_phase", {}).values() if phase in phases]
    return {"up": sum(r["up"] for r in rows), "down": sum(r["down"] for r in rows),
            "seconds": sum(r.get("seconds", 0.0) for r in rows)}


def figures(summary: dict[str, Any], comm: dict[str, Any], curve: list[float] | None,
            prior_bytes: int = 0) -> dict[str, Any]:
    """A cell's figures from its run's summary.json and comm.json (and accuracy curve, multi-round runs). The
    final evaluation and the prior's shipment are left out of the method's bytes: a node keeps a shipped prior,
    so whether a run ships it depends on the runs before it; `prior_bytes` (the prior's records, what a client
    downloads or copies once; 0 when its clients need no prior) stands beside them instead."""
    m, totals, clients = summary["metrics"], summary["comm"], summary["num_clients"]
    ev, shipped = phase_cost(comm, EVALUATE), phase_cost(comm, PRIOR)
    left_out = {k: ev[k] + shipped[k] for k in ev}
    per_client = [100 * v for v in (m.get("per_client_accuracy") or {}).values()]
    rounds = 0 if m.get("oracle") else (len(curve) if curve is not None else 1)
    client_seconds = totals.get("compute_seconds", 0.0)
    return {
        "accuracy": 100 * m["accuracy"],
        "client_accuracy_mean": statistics.fmean(per_client) if per_client else None,
        "client_accuracy_std": statistics.pstdev(per_client) if per_client else None,
        "per_client_accuracy": per_client,
        "up_bytes_per_client": (totals["up_bytes"] - left_out["up"]) / clients,
        "down_bytes_per_client": (totals["down_bytes"] - left_out["down"]) / clients,
        "prior_bytes_per_client": prior_bytes,
        "rounds": rounds,
        "client_seconds_per_client": (client_seconds - left_out["seconds"]) / clients,
        "server_seconds": summary["wall_seconds"] - client_seconds,
        "wall_seconds": summary["wall_seconds"],
        "verdict": classification_verdict(curve) if curve is not None else None,
    }


def ships_prior(comm: dict[str, Any]) -> bool:
    """Whether the run's method asks its nodes for the built-in prior (whether or not they held it already)."""
    return any(PRIOR in phases for phases in comm.get("by_phase", {}).values())


def run_cell(flat: dict[str, Any], clients: int) -> dict[str, Any]:
    """Run one cell (in-process) and return its figures. Caches a method keeps across runs of one process
    are emptied first, so that every cell pays for its own clients' work."""
    import sys

    if "clients.feddifrc" in sys.modules:  # the target basis every client fits from the public images
        sys.modules["clients.feddifrc"]._BASES.clear()
        sys.modules["clients.feddifrc"]._SHARED.clear()
    summary = run(flat, clients, "inprocess")
    if summary.get("status") != "completed":
        raise RuntimeError(f"{flat['run-name']}: {summary.get('status')} ({summary.get('error')})")
    return run_figures(flat, summary)


def run_figures(flat: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """A finished run's figures, from what it wrote."""
    comm = json.loads((Path(summary["run_dir"]) / "comm.json").read_text())
    curve = accuracy_curve(summary) if round_based(flat["method"]) else None
    holds = ships_prior(comm) or flat["method"] in CLIENTS_LOAD_PRIOR
    return figures(summary, comm, curve, prior_record_bytes(flat) if holds else 0)


def refigure(flat: dict[str, Any], clients: int) -> dict[str, Any] | None:
    """A cell's figures read again from its run's folder (after the figures' definitions changed), None when
    the folder is gone or the run did not complete."""
    from fedapp.simulation import resolve_run_config

    path = resolve_run_config(flat, clients)[1] / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    return run_figures(flat, summary) if summary.get("status") == "completed" else None


def prior_record_bytes(flat: dict[str, Any]) -> int:
    """The bytes of the records a built-in prior ships as (its weights and files); 0 for a hub or folder prior,
    which every node loads from its own disk."""
    from fedapp.config import all_defaults

    return _prior_record_bytes(flat.get("prior", all_defaults()["prior"]), flat["dataset"])


@functools.lru_cache(maxsize=None)  # a 17 MB prior serialised once a run, not once a cell
def _prior_record_bytes(prior: str, dataset: str) -> int:
    from flwr.app import RecordDict

    from fedapp.models.prior import prior_to_records
    from fedapp.models.prior.spec import resolve_prior
    from fedapp.protocols.records import record_nbytes

    src = resolve_prior(prior, dataset)
    if src.kind != "tiny":
        return 0
    weights, files = prior_to_records(src.location)
    return record_nbytes(RecordDict({"weights": weights, "files": files}))


def warm_priors(configs: list[dict[str, Any]]) -> None:
    """Build (or load) every prior the cells read, before any cell is timed."""
    from fedapp import registry
    from fedapp.config import all_defaults
    from fedapp.models.prior import load_or_build_prior

    for spec, dataset in sorted({(c.get("prior", all_defaults()["prior"]), c["dataset"]) for c in configs
                                 if registry.METHODS[c["method"]].uses_prior}):
        print(f"prior {spec} for {dataset}: built or loaded before the cells", flush=True)
        load_or_build_prior(spec, dataset)


KEYS = ("accuracy", "client_accuracy_mean", "client_accuracy_std", "up_bytes_per_client", "down_bytes_per_client",
        "prior_bytes_per_client", "rounds", "client_seconds_per_client", "server_seconds", "wall_seconds",
        "attack_auc")
AUC = "attack_auc"  # the privacy audit's strongest membership attack on the cell (experiments/privacy_audit.py)


def summarise(cells: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """entry -> mean and std over seeds of every figure, the seeds, how many multi-round seeds converged, and
    the same-seed accuracy difference against BASELINE."""
    out = {}
    for entry, by_seed in cells.items():
        row: dict[str, Any] = {"seeds": sorted(by_seed, key=int)}
        for k in KEYS:
            vals = [c[k] for c in by_seed.values() if c.get(k) is not None]
            row[k] = {"mean": statistics.fmean(vals), "std": statistics.pstdev(vals)} if vals else None
        verdicts = [c["verdict"] for c in by_seed.values() if c.get("verdict")]
        row["converged"] = f"{sum(v['converged'] for v in verdicts)} of {len(verdicts)}" if verdicts else None
        if BASELINE in cells and entry != BASELINE:
            acc = {s: c["accuracy"] for s, c in by_seed.items()}
            row["vs_baseline"] = paired_difference(acc, {s: c["accuracy"] for s, c in cells[BASELINE].items()},
                                                   True)
        out[entry] = row
    return out


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """The names no other point dominates, for (cost, accuracy): lower cost and higher accuracy are better; a
    point is dominated by one at most as costly and at least as accurate, better in one of the two."""
    def dominated(p: tuple[float, float]) -> bool:
        return any(q[0] <= p[0] and q[1] >= p[1] and q != p for q in points.values())

    return sorted((n for n, p in points.items() if not dominated(p)), key=lambda n: points[n][0])


def mean_of(row: dict[str, Any], key: str) -> float | None:
    return row[key]["mean"] if row.get(key) else None


def std_of(row: dict[str, Any], key: str) -> float:
    return row[key]["std"] if row.get(key) else 0.0


def fronts(summary: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """The Pareto front against upload bytes, wall time and the attack AUC (entries with both figures)."""
    out = {}
    for key in ("up_bytes_per_client", "wall_seconds", AUC):
        pts = {n: (mean_of(r, key), mean_of(r, "accuracy")) for n, r in summary.items()
               if mean_of(r, key) is not None and n not in ORACLES}
        out[key] = pareto_front(pts)
    return out


def human_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def pm(row: dict[str, Any], key: str, digits: int = 1) -> str:
    return f"{row[key]['mean']:.{digits}f} ± {row[key]['std']:.{digits}f}" if row.get(key) else "n/a"


def seconds(row: dict[str, Any], key: str) -> str:
    """Seconds to three significant figures at most, whole seconds from 100 on."""
    if not row.get(key):
        return "n/a"
    digits = 0 if row[key]["mean"] >= 100 else 1 if row[key]["mean"] >= 10 else 2
    return pm(row, key, digits)


def table_text(summary: dict[str, dict[str, Any]], front: dict[str, list[str]]) -> str:
    head = ("| entry | seeds | accuracy % | − FedAvg, same seeds | clients' accuracy % (spread over clients) | "
            "up / client | down / client | prior, once / client | rounds | client s / client | server s | wall s | "
            "converged | attack AUC |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for n, r in summary.items():
        mark = " ◆" if n in front.get("up_bytes_per_client", []) else ""
        mark += " ⧗" if n in front.get("wall_seconds", []) else ""
        mark += " ◎" if n in front.get(AUC, []) else ""
        spread = f" (± {r['client_accuracy_std']['mean']:.1f})" if r.get("client_accuracy_std") else ""
        lines.append(
            f"| {n}{mark} | {len(r['seeds'])} | {pm(r, 'accuracy')} | {paired_text(r.get('vs_baseline'))} | "
            f"{pm(r, 'client_accuracy_mean')}{spread} | {human_bytes(mean_of(r, 'up_bytes_per_client'))} | "
            f"{human_bytes(mean_of(r, 'down_bytes_per_client'))} | "
            f"{human_bytes(mean_of(r, 'prior_bytes_per_client'))} | {mean_of(r, 'rounds') or 0:.0f} | "
            f"{seconds(r, 'client_seconds_per_client')} | {seconds(r, 'server_seconds')} | "
            f"{seconds(r, 'wall_seconds')} | "
            f"{r['converged'] or '—'} | {pm(r, AUC, 3) if r.get(AUC) else '—'} |")
    lines.append("")
    lines.append("◆ on the Pareto front of accuracy against upload bytes; ⧗ against wall time; ◎ against the attack "
                 "AUC (the privacy audit's strongest membership attack, docs/privacy.md; — not audited).")
    return "\n".join(lines)


def plot(summary: dict[str, dict[str, Any]], front: dict[str, list[str]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("up_bytes_per_client", "bytes uploaded per client (log)", True),
              ("wall_seconds", "wall time, s (log)", True)]
    if any(r.get(AUC) for r in summary.values()):  # audited cells: accuracy against what an attacker learns
        panels.append((AUC, "membership attack AUC, strongest attack (0.5: chance)", False))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.6))
    for ax, (key, label, log) in zip(axes, panels):
        accuracy_panel(ax, summary, front, key, label, log)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{title}: mean ± std over seeds; filled: on the Pareto front")
    fig.tight_layout()
    save_png(fig, path)


def accuracy_panel(ax: Any, summary: dict[str, dict[str, Any]], front: dict[str, list[str]], key: str, label: str,
                   log: bool) -> None:
    """Accuracy against one cost (`key`, lower is better) on `ax`: mean ± std over seeds, the entries on its Pareto
    front filled and joined, the oracle as a reference line."""
    names = [n for n, r in summary.items() if n not in ORACLES and mean_of(r, key) is not None
             and (mean_of(r, key) > 0 or not log)]
    for n in names:
        r = summary[n]
        ax.errorbar(mean_of(r, key), mean_of(r, "accuracy"), xerr=std_of(r, key), yerr=std_of(r, "accuracy"),
                    fmt="o", capsize=3, label=n, mfc="none" if n not in front.get(key, []) else None)
        ax.annotate(n, (mean_of(r, key), mean_of(r, "accuracy")), textcoords="offset points", xytext=(4, 4),
                    fontsize=7)
    on = [n for n in front.get(key, []) if n in names]
    ax.step([mean_of(summary[n], key) for n in on], [mean_of(summary[n], "accuracy") for n in on],
            where="post", color="k", lw=1, ls="--", label="Pareto front")
    for n in (n for n in ORACLES if n in summary):
        ax.axhline(mean_of(summary[n], "accuracy"), color="grey", ls=":", lw=1, label=f"{n} (oracle)")
    if names and log:  # an oracle-only table has no point to put on a log axis
        ax.set_xscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel("global test accuracy, %")
    ax.grid(alpha=0.3)


def shown_command(name: str, argv: list[str]) -> str:
    """The command line a page shows for `python -m experiments <name>` run with argv: its shown_options,
    shell-quoted (an empty value such as `--generative ""` stays an argument)."""
    return f"{prog(name)} {shlex.join(shown_options(argv))}"


def shown_options(argv: list[str]) -> list[str]:
    """The command's options without the ones that move no figure (where files go, torch threads) or no row (the
    table shows every entry's cells on disk, whichever --entries ran them): the page shows the command a reader
    runs to measure the same cells."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--refigure", "--no-run"):
            continue
        elif arg.split("=")[0] in ("--out", "--doc", "--runs", "--threads", "--entries"):
            skip = "=" not in arg
        else:
            out.append(arg)
    return out


def parser() -> argparse.ArgumentParser:
    shared = common_args(dataset="mnist-styles", seeds="0,1,2", set=[], out="docs/results/leaderboard",
                         runs="runs/leaderboard", threads=1, helps={"set": "run-config overrides for every cell"})
    p = argparse.ArgumentParser(prog=prog("leaderboard"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, parents=[shared])
    p.add_argument("--partitioner", default="domain", choices=sorted(SETTINGS))
    p.add_argument("--alpha", type=float, default=0.1, help="the Dirichlet concentration (--partitioner dirichlet)")
    p.add_argument("--entries", default=",".join(ENTRIES),
                   help=f"the entries whose cells to run, a subset of {','.join(ENTRIES)}; the table shows every "
                        "entry with cells on disk at --seeds")
    p.add_argument("--doc", default="docs/leaderboard.md", help="the page the setting's table is written into")
    p.add_argument("--audit", default="docs/results/privacy_audit",
                   help="folder of the privacy audit's results: its strongest attack AUC per cell fills the table's "
                        "privacy column (python -m experiments privacy-audit --scale leaderboard)")
    p.add_argument("--no-run", action="store_true",
                   help="run no cell: write the table, plot and page from the cells already on disk")
    p.add_argument("--refigure", action="store_true",
                   help="read the figures of cells on disk again from their runs' folders (under --runs)")
    return p


def main(argv: list[str]) -> None:
    a = parser().parse_args(argv)
    pin_threads(a.threads)
    with config_errors_exit():
        entries = subset_of("entries", a.entries, ENTRIES)
        seeds = parse_seeds(a.seeds)
        # seed-major: every entry of a seed before the next seed, so a table cut short is a whole seed sooner
        # the table is the setting's: every entry with cells on disk at these seeds, whichever entries this call runs
        table = {(e, s): cell_config(a, e, s) for e in ENTRIES for s in seeds}
        configs = {(e, s): table[e, s] for s in seeds for e in entries}
    clients = SETTINGS[a.partitioner]["clients"]
    check_configs(list(configs.values()), clients)
    quiet_logs()
    setting, out = setting_name(a), Path(a.out)
    cells_dir = out / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    if a.refigure:
        for (entry, seed), flat in configs.items():
            if cell_file(cells_dir, flat).is_file() and (figs := refigure(flat, clients)) is not None:
                atomic_write_json(cell_file(cells_dir, flat), {"entry": entry, "seed": seed, "config": flat,
                                                               "figures": figs})
    todo = {k: f for k, f in configs.items() if not cell_file(cells_dir, f).is_file()}
    print(f"leaderboard {setting}: {len(configs) - len(todo)} of {len(configs)} cells on disk", flush=True)
    if a.no_run:  # the table of the cells on disk; each entry's seeds column says how many it has
        todo = {}
    if todo:
        warm_priors(list(todo.values()))
    failed: dict[str, str] = {}

    def publish() -> str:  # after every cell, so that a table cut short has its finished cells on the page
        return write_outputs(a, argv, table, cells_dir, failed)

    text = None  # the table as last published; None when nothing since (a failure, or no cell run)
    for (entry, seed), flat in todo.items():
        print(f"cell {entry}, seed {seed}", flush=True)
        try:
            figs = run_cell(flat, clients)
        except Exception as err:  # noqa: BLE001 - one cell's failure is reported; the other cells go on
            failed[f"{entry}, seed {seed}"] = f"{type(err).__name__}: {err}"
            print(f"cell {entry}, seed {seed} failed: {failed[f'{entry}, seed {seed}']}", flush=True)
            text = None
            continue
        atomic_write_json(cell_file(cells_dir, flat), {"entry": entry, "seed": seed, "config": flat, "figures": figs})
        print(f"cell {entry}, seed {seed}: accuracy {figs['accuracy']:.2f} %, "
              f"{figs['up_bytes_per_client']:,.0f} bytes up a client, {figs['wall_seconds']:.0f} s", flush=True)
        text = publish()
    print(text if text is not None else publish(), flush=True)


def with_attack_auc(cells: dict[str, dict[str, dict[str, Any]]], audit: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """The cells' figures with the privacy audit's strongest attack AUC (AUC) of the same entry and seed, where the
    audit of this setting (`python -m experiments privacy-audit --scale leaderboard`) has one."""
    if not audit.is_file():
        return cells
    kept = json.loads(audit.read_text())["cells"]
    out = {}
    for entry, by_seed in cells.items():
        out[entry] = {}
        for seed, figs in by_seed.items():
            best = strongest(kept.get(entry, {}).get(seed, {}))
            out[entry][seed] = {**figs, AUC: best["auc"]} if best else figs
    return out


def write_outputs(a: argparse.Namespace, argv: list[str], configs: dict[tuple[str, int], dict[str, Any]],
                  cells_dir: Path, failed: dict[str, str]) -> str:
    """The setting's JSON, plot and page block from the cells of `configs` on disk, in ENTRIES' order (a cell
    not on disk, a failed one included, is left out and runs next time); returns the table's markdown."""
    setting, out, clients = setting_name(a), Path(a.out), SETTINGS[a.partitioner]["clients"]
    cells: dict[str, dict[str, dict[str, Any]]] = {}
    order = list(ENTRIES)
    for (entry, seed), flat in sorted(configs.items(), key=lambda kv: order.index(kv[0][0])):  # stable: seeds kept
        if cell_file(cells_dir, flat).is_file():
            cells.setdefault(entry, {})[str(seed)] = json.loads(cell_file(cells_dir, flat).read_text())["figures"]
    shown = list(cells)
    audited = with_attack_auc(cells, Path(a.audit) / f"audit_{setting}-leaderboard.json")
    summary = summarise(audited)
    front = fronts(summary)
    text = table_text(summary, front)
    seeds = list(dict.fromkeys(s for _, s in configs))
    atomic_write_json(out / f"leaderboard_{setting}.json",
                      {"setting": {"dataset": a.dataset, "partitioner": a.partitioner, "clients": clients,
                                   **({"alpha": a.alpha} if a.partitioner == "dirichlet" else {}),
                                   "seeds": seeds, "set": a.set, "budgets": SETTINGS[a.partitioner]},
                       "entries": {e: ENTRIES[e] for e in shown}, "baseline": BASELINE,  # vs_baseline pairs against it
                       "summary": summary, "pareto": front,
                       "cells": cells, "failed_cells": failed, "table_markdown": text})
    plot(summary, front, out / f"leaderboard_{setting}.png", setting)
    command = shown_command("leaderboard", argv)
    block = f"### {setting}\n\n`{command}`\n\n{text}"
    png = out / f"leaderboard_{setting}.png"
    if png.resolve().is_relative_to(Path(a.doc).resolve().parent):  # the page shows the plot beside its table
        block += f"\n\n![{setting}]({png.resolve().relative_to(Path(a.doc).resolve().parent).as_posix()})"
    write_block(Path(a.doc), f"leaderboard:{setting}", block)
    return text
