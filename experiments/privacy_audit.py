"""The privacy audit (docs/privacy.md): one membership-inference protocol for every method, beside accuracy,
bytes and time.

    python -m experiments privacy-audit --seeds 0,1,2                          # the tiny audit (the default)
    python -m experiments privacy-audit --scale leaderboard --dataset mnist-styles --partitioner domain \\
        --runs runs/leaderboard --seeds 0,1,2                                   # the leaderboard's own cells

Cells: the leaderboard's entries (experiments/leaderboard.py ENTRIES, its cell_config: the same partition and
budgets; `--scale tiny` shrinks them through TINY) and the generation methods (GENERATIVE: PFDM, DCFM), each run
with `log.uploads = true` so that its folder keeps what every client uploaded (a run folder that already has
them is attacked without running again). Per cell and client, experiments/audit_targets.py turns what the
attacker holds into membership scores; fedapp/audit/ gives AUC and TPR at 1 % FPR with bootstrap intervals
(client scores pooled), and for generative uploads the near-copy share. Controls per seed, built to leak or
not: a classifier overfitted on one client's few images (CONTROL_OVERFIT), the same model scored on two halves
of its non-members (CONTROL_SAME: no member at all), and PFDM with its noise off (pfdm.t0 = 1).

Resumable as the leaderboard is: a finished cell's figures are kept in <out>/cells/ by a digest of its run
config and the audit's own settings. Writes <out>/audit_<setting>.json (the leaderboard reads its strongest
attack AUC per entry into its privacy column), <out>/audit_<setting>.png (accuracy against attack AUC, the front
marked; member and non-member distances of the generated images) and the setting's blocks into docs/privacy.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from experiments import audit_targets as T
from experiments import leaderboard as L
from fedapp.audit.membership import strongest
from experiments.cli import common_args, pin_threads
from experiments.common import config_errors_exit, prog, quiet_logs, run, subset_of, write_block
from fedapp.results import atomic_write_json, save_png

# the tiny classification setting: leaderboard cells shrunk to minutes of one core a seed (digit-styles' 16 px
# pixel prior, 8 images a class a client, 10 rounds, 1 synthetic image per real one)
TINY = {"prior": "tiny", "image-size": 16, "partitioner.per-class": 8, "num-server-rounds": 10, "local-epochs": 3,
        "server-epochs": 10, "espresso.ratio": 1.0, "espresso.embed-steps": 30}
DEFAULT_ENTRIES = [e for e in L.ENTRIES if e != "Espresso (paper)"]  # its upload is Espresso's; its sampler differs
KEEP = {"log.uploads": True, "espresso.save-synthetic": True}  # what each audited run keeps for the attacks
GEN_CLIENTS = 4
PFDM = {"method": "pfdm", "dataset": "colored-digits", "partitioner.name": "minority"}  # PFDM's table (docs/pfdm.md)
GENERATIVE = {
    "PFDM": PFDM,
    "PFDM noise off (control)": {**PFDM, "pfdm.t0": 1},  # x~ ~ x: epsilon is unbounded; built to leak
    "DCFM": {"method": "dcfm", "dataset": "colored-digits", "partitioner.name": "attribute-holdout"},
}
# the generation cells at the tiny scale; --scale leaderboard runs them at their own tables' settings (TABLES)
GENERATIVE_TINY = {
    "pfdm": {"image-size": 8, "partitioner.per-class": 16, "pfdm.local-steps": 150, "pfdm.shared-steps": 150,
             "pfdm.samples": 20, "pfdm.attack-samples": 20, "pfdm.sample-steps": 10},
    "dcfm": {"image-size": 8, "partitioner.per-class": 16, "batch-size": 32, "dcfm.local-steps": 100,
             "dcfm.distill-steps": 100, "dcfm.replay-paths": 48, "dcfm.sample-steps": 12, "dcfm.samples-per-pair": 2,
             "dcfm.width": 16, "dcfm.ref-epochs": 3},
}
# docs/pfdm.md's 8 px table (experiments/pfdm.py's defaults: whole shards, 400 steps a denoiser, 40 sampler steps)
PFDM_TABLE = {"image-size": 8, "partitioner.per-class": 0, "pfdm.local-steps": 400, "pfdm.shared-steps": 400,
              "pfdm.sample-steps": 40}
CONTROL_OVERFIT = "Overfitted classifier (control)"
CONTROL_SAME = "Same distribution (control)"
CONTROL_TRAINING = "members alone"  # what the overfitted control trains on: in its cells' digest, not the entries'
SCALES = ("tiny", "leaderboard")


# ---- cells ------------------------------------------------------------------------------------------------
def classify_config(a: argparse.Namespace, entry: str, seed: int) -> dict[str, Any]:
    """A leaderboard cell's config (the same partition, budget and seed), shrunk by TINY at --scale tiny, with
    the uploads kept."""
    extra = [f"{k}={json.dumps(v)}" for k, v in TINY.items()] if a.scale == "tiny" else []
    ns = argparse.Namespace(dataset=a.dataset, partitioner=a.partitioner, alpha=a.alpha, set=extra + a.set,
                            runs=a.runs)
    return {**L.cell_config(ns, entry, seed), **KEEP}


def generative_config(a: argparse.Namespace, entry: str, seed: int) -> dict[str, Any]:
    flat = dict(GENERATIVE[entry])
    flat.update(GENERATIVE_TINY[flat["method"]] if a.scale == "tiny" else tables()[flat["method"]])
    return {**flat, "seed": seed, "min-clients": GEN_CLIENTS, "device": "cpu", "out-dir": a.runs,
            "run-name": f"audit-{L.slug(entry)}{'' if a.scale == 'tiny' else '-table'}-s{seed}", **KEEP}


def tables() -> dict[str, dict[str, Any]]:
    """The generation cells at their tables' settings: PFDM's 8 px table, DCFM's table (experiments/dcfm.py
    SETTINGS, whole shards)."""
    from experiments.dcfm import SETTINGS as DCFM_TABLE

    return {"pfdm": PFDM_TABLE, "dcfm": {**DCFM_TABLE, "partitioner.per-class": 0}}


def audit_settings(a: argparse.Namespace) -> dict[str, Any]:
    """The audit's own knobs: part of every cell's digest, so a change re-attacks (never re-runs) the cells."""
    return {"cap": a.cap, "shadows": a.shadows, "overfit_epochs": a.overfit_epochs, "resamples": a.resamples}


def cell_file(cells: Path, name: str, flat: dict[str, Any], settings: dict[str, Any]) -> Path:
    from fedapp.models.cache import facts_digest

    facts = {**{k: v for k, v in flat.items() if k not in ("out-dir",)}, "audit": settings}
    return cells / f"{name}-{facts_digest(facts)}.json"


def ensure_run(flat: dict[str, Any], clients: int) -> Path:
    """The run folder of `flat`, run first (in-process) unless it completed and kept its uploads. A folder of
    the same name whose config.json differs on a key it holds is refused: the figures would be another run's."""
    from fedapp.server.uploads import kept_phases
    from fedapp.simulation import resolve_run_config

    resolved, folder = resolve_run_config(flat, clients)
    summary = folder / "summary.json"
    done = summary.is_file() and json.loads(summary.read_text()).get("status") == "completed"
    if done:
        from fedapp.config import parse_run_config

        held, want = json.loads((folder / "config.json").read_text()), parse_run_config(resolved).flat()
        moved = sorted(k for k, v in held.items() if k in want and k not in (*KEEP, "out-dir") and want[k] != v)
        if moved:
            raise ValueError(f"run folder {folder} holds another run config ({', '.join(moved)} differ): "
                             "pass another --runs")
    if not (done and (T.KINDS[flat["method"]] == "none" or T.UPLOAD_PHASE in kept_phases(folder))):
        result = run(flat, clients, "inprocess")
        if result.get("status") != "completed":
            raise RuntimeError(f"{flat['run-name']}: {result.get('status')} ({result.get('error')})")
    return folder


# ---- attacking one run --------------------------------------------------------------------------------------
def figures_of(scores: dict[int, tuple[np.ndarray, np.ndarray]], seed: int, resamples: int) -> dict[str, Any]:
    """Bootstrap figures of the clients' scores pooled, and each client's AUC."""
    from fedapp.audit.membership import bootstrap_figures, mia_figures

    m = np.concatenate([s[0] for s in scores.values()])
    n = np.concatenate([s[1] for s in scores.values()])
    out = bootstrap_figures(m, n, seed=seed, resamples=resamples)
    out["per_client_auc"] = {str(p): mia_figures(*s)["mia_auc"] for p, s in sorted(scores.items())}
    return out


def pooled_near_copies(per_client: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Near-copy figures over clients (each client's threshold set on its own non-members): the share of all
    generated images that are near-copies, and every distance for the distributions."""
    gen = sum(r["generated"] for r in per_client.values())
    d_mem = [d for r in per_client.values() for d in r["member_distances"]]
    d_non = [d for r in per_client.values() for d in r["nonmember_distances"]]
    return {"near_copy_share": sum(r["near_copy_share"] * r["generated"] for r in per_client.values()) / gen,
            "nonmember_share": sum(r["nonmember_share"] * r["generated"] for r in per_client.values()) / gen,
            "member_closer_share": float(np.mean(np.array(d_mem) < np.array(d_non))),
            "median_member_distance": float(np.median(d_mem)), "median_nonmember_distance": float(np.median(d_non)),
            "generated": gen, "member_distances": d_mem, "nonmember_distances": d_non}


DISTANCES = ("member_distances", "nonmember_distances")  # kept in the cell files, not in the setting's JSON


def without_distances(cells: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """The cells as the setting's JSON keeps them: every figure, not the per-image distances (megabytes a
    setting; the cell files under <out>/cells/ keep them, and the plot reads them from there)."""
    def lean(c: dict[str, Any]) -> dict[str, Any]:
        if "reconstruction" not in c:
            return c
        return {**c, "reconstruction": {k: v for k, v in c["reconstruction"].items() if k not in DISTANCES}}
    return {e: {s: lean(c) for s, c in by.items()} for e, by in cells.items()}


def audit_run(run_dir: Path, settings: dict[str, Any], seed: int) -> dict[str, Any]:
    """Every attack on one finished run: {"attacks": {"<threat>/<attack>": figures}, "reconstruction": ...}."""
    from fedapp.audit.reconstruction import near_copy_figures

    view = T.RunView.load(run_dir)
    kind = T.KINDS[view.method]
    cands = T.candidates(view, settings["cap"], seed)
    uploads = view.uploads() if kind != "none" else {}
    shards = T.all_shards(view)
    scores: dict[str, dict[int, tuple]] = {}
    recon: dict[int, dict[str, Any]] = {}
    for pid, (mem, non) in cands.items():
        up = uploads.get(pid)
        if up is not None and kind == "model":
            for attack, s in T.model_upload_scores(view, up, mem, non, settings["shadows"], seed + pid).items():
                scores.setdefault(f"upload/{attack}", {})[pid] = s
        elif up is not None:
            gen = T.generated_images(view, pid, up, shards[pid].train, seed + pid)
            scores.setdefault("upload/nearest", {})[pid] = T.nearest_attack(view, gen, mem, non)
            recon[pid] = near_copy_figures(T.features(view, gen), T.features(view, mem.x), T.features(view, non.x))
        if kind == "release":
            g = T.pfdm_global_scores(view, mem, non, seed + pid)
        elif kind == "experts":
            g = {"nearest": T.nearest_attack(view, T.flow_images(view, view.final_state(), shards[pid].train,
                                                                   seed + pid), mem, non)}
        else:
            g = T.global_classifier_scores(view, mem, non)
        for attack, s in g.items():
            scores.setdefault(f"global/{attack}", {})[pid] = s
    attacks = {k: figures_of(v, seed, settings["resamples"]) for k, v in sorted(scores.items())}
    out: dict[str, Any] = {"attacks": attacks, "reader_accuracy": T.reader_accuracy(view)}
    if recon:
        out["reconstruction"] = {**pooled_near_copies(recon),
                                 "per_client_share": {str(p): r["near_copy_share"] for p, r in sorted(recon.items())}}
    return out


def controls(view: T.RunView, settings: dict[str, Any], seed: int) -> dict[str, dict[str, Any]]:
    """The overfitted-classifier control (trained for `overfit_epochs` local epochs on the member sample alone of
    the client with the most members (the first on ties), so that every member is a training image and no other
    image is, and its interval is the tightest a client gives; loss and likelihood-ratio attacks as on an
    upload; its accuracy on members and non-members, the generalisation gap the attacks read) and, with the same
    model, the no-member control: every client's non-members pooled and split at random into two halves, one
    called members (no member at all: chance)."""
    import torch

    from fedapp.audit.scores import classifier_loss_scores
    from fedapp.models.classifier import accuracy

    cands = T.candidates(view, settings["cap"], seed)
    client = max(cands, key=lambda pid: len(cands[pid][0]))
    mem, non = cands[client]
    model, start = T.overfit_model(view, mem, settings["overfit_epochs"], seed)
    loss = (classifier_loss_scores(model, mem.x, mem.y), classifier_loss_scores(model, non.x, non.y))
    lira = T.lira_scores(view, model, start, mem, mem, non, settings["shadows"], seed, settings["overfit_epochs"])
    gap = {"client": client, "member_accuracy": accuracy(model, mem.x.float(), mem.y),
           "nonmember_accuracy": accuracy(model, non.x.float(), non.y)}
    x, y = torch.cat([n.x for _, n in cands.values()]), torch.cat([n.y for _, n in cands.values()])
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    a, b = order[:len(y) // 2], order[len(y) // 2:2 * (len(y) // 2)]
    same = (classifier_loss_scores(model, x[a], y[a]), classifier_loss_scores(model, x[b], y[b]))
    fig = lambda s: figures_of({0: s}, seed, settings["resamples"])  # noqa: E731
    return {CONTROL_OVERFIT: {"attacks": {"upload/loss": fig(loss), "upload/lira": fig(lira)}, **gap},
            CONTROL_SAME: {"attacks": {"upload/loss": fig(same)}}}


# ---- summaries, page and plot -----------------------------------------------------------------------------------
def summarise(cells: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """entry -> attack -> mean and std over seeds of the AUC and TPR at 1 % FPR, the mean of the seeds' interval
    bounds, each seed's member count (seed order), and of the near-copy share; the strongest attack's AUC as
    `attack_auc` {mean, std}."""
    out = {}
    for entry, by_seed in cells.items():
        by_seed = {s: by_seed[s] for s in sorted(by_seed, key=int)}
        row: dict[str, Any] = {"seeds": list(by_seed), "attacks": {}}
        names = sorted({k for c in by_seed.values() for k in c.get("attacks", {})},
                       key=lambda k: (not k.startswith("upload/"), k))  # the upload's attacks first
        for name in names:
            got = [c["attacks"][name] for c in by_seed.values() if name in c.get("attacks", {})]
            row["attacks"][name] = {
                "seeds": len(got),
                **{f: _over([g[f]["value"] for g in got]) for f in ("mia_auc", "mia_tpr_at_1fpr")},
                "low": statistics.fmean(g["mia_auc"]["low"] for g in got),
                "high": statistics.fmean(g["mia_auc"]["high"] for g in got),
                "tpr_low": statistics.fmean(g["mia_tpr_at_1fpr"]["low"] for g in got),
                "tpr_high": statistics.fmean(g["mia_tpr_at_1fpr"]["high"] for g in got),
                "members": [g["members"] for g in got], "fpr_step": max(g["fpr_step"] for g in got)}
        recon = [c["reconstruction"] for c in by_seed.values() if "reconstruction" in c]
        if recon:
            row["near_copy_share"] = _over([r["near_copy_share"] for r in recon])
            row["nonmember_share"] = _over([r["nonmember_share"] for r in recon])
            row["member_closer_share"] = _over([r["member_closer_share"] for r in recon])
        best = [s for s in (strongest(c) for c in by_seed.values()) if s]
        if best:
            row["attack_auc"] = _over([b["auc"] for b in best])
            row["strongest"] = sorted({b["attack"] for b in best})
        if any("accuracy" in c for c in by_seed.values()):
            row["accuracy"] = _over([c["accuracy"] for c in by_seed.values() if "accuracy" in c])
        out[entry] = row
    return out


def _member_counts(per_seed: list[int]) -> str:
    """`n + n` where every seed attacks as many members, else each seed's `n + n` in seed order."""
    counts = per_seed if len(set(per_seed)) > 1 else per_seed[:1]
    return ", ".join(f"{n} + {n}" for n in counts)


def _over(vals: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(vals), "std": statistics.pstdev(vals)}


def attack_table(summary: dict[str, dict[str, Any]]) -> str:
    head = ("| entry | attacker holds | attack | seeds | AUC | 95 % interval (mean of seeds') | TPR @ 1 % FPR | "
            "members + non-members / seed | near copies %: of members / of non-members | nearer a member % |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for entry, row in summary.items():
        for name, f in row["attacks"].items():
            threat, attack = name.split("/")
            copies = " | "
            if threat == "upload" and "near_copy_share" in row:
                near, closer = row["near_copy_share"], row["member_closer_share"]
                copies = (f"{100 * near['mean']:.1f} ± {100 * near['std']:.1f} / "
                          f"{100 * row['nonmember_share']['mean']:.1f} | "
                          f"{100 * closer['mean']:.0f} ± {100 * closer['std']:.0f}")
            lines.append(f"| {entry} | {'its upload' if threat == 'upload' else 'the final model'} | "
                         f"{ATTACK_NAMES[attack]} | {f['seeds']} | "
                         f"{f['mia_auc']['mean']:.3f} ± {f['mia_auc']['std']:.3f} | "
                         f"[{f['low']:.3f}, {f['high']:.3f}] | {100 * f['mia_tpr_at_1fpr']['mean']:.1f} % "
                         f"[{100 * f['tpr_low']:.1f}, {100 * f['tpr_high']:.1f}] | {_member_counts(f['members'])} | "
                         f"{copies} |")
    return "\n".join(lines)


ATTACK_NAMES = {"loss": "loss", "lira": "likelihood ratio (shadows)", "nearest": "nearest generated image"}


def plot_distances(cells: dict[str, dict[str, dict[str, Any]]], ax) -> None:
    """Member against non-member nearest distances of the generated images, one box pair per generative entry."""
    names = [e for e, by in cells.items() if any("reconstruction" in c for c in by.values())]
    data, labels = [], []
    for e in names:
        rec = [c["reconstruction"] for c in cells[e].values() if "reconstruction" in c]
        data += [[d for r in rec for d in r["member_distances"]], [d for r in rec for d in r["nonmember_distances"]]]
        labels += [f"{e}\nmembers", f"{e}\nnon-members"]
    if data:
        ax.boxplot(data, showfliers=False)
        ax.set_xticks(range(1, len(labels) + 1), labels, rotation=60, fontsize=6, ha="right")
    ax.set_ylabel("reader-feature distance")
    ax.set_title("each generated image's distance to its nearest member / non-member", fontsize=9)


def write_outputs(a: argparse.Namespace, argv: list[str], setting: str, cells: dict[str, dict[str, dict[str, Any]]],
                  failed: dict[str, str]) -> str:
    """The setting's JSON, plot and page blocks from the cells so far; returns the attack table."""
    out = Path(a.out)
    summary = summarise(cells)
    text = attack_table(summary)
    board_cells = {e: {s: {**c.get("leaderboard", {}), **({"attack_auc": strongest(c)["auc"]} if strongest(c) else {})}
                       for s, c in by.items()} for e, by in cells.items() if e in L.ENTRIES}
    board = L.summarise({e: by for e, by in board_cells.items() if all("accuracy" in c for c in by.values())})
    front = L.fronts(board)
    atomic_write_json(out / f"audit_{setting}.json",
                      {"setting": setting, "scale": a.scale, "seeds": a.seeds, "set": a.set,
                       "settings": audit_settings(a), "summary": summary, "leaderboard": board, "pareto": front,
                       "cells": without_distances(cells), "failed_cells": failed, "table_markdown": text})
    plot(board, front, cells, out / f"audit_{setting}.png", setting)
    command = L.shown_command("privacy-audit", argv)
    block = f"### {setting}\n\n`{command}`\n\n{text}"
    if board:
        block += "\n\nThe same cells as a leaderboard (accuracy, bytes, time and the strongest attack's AUC):\n\n"
        block += L.table_text(board, front)
    png = out / f"audit_{setting}.png"
    if png.resolve().is_relative_to(Path(a.doc).resolve().parent):
        block += f"\n\n![{setting}]({png.resolve().relative_to(Path(a.doc).resolve().parent).as_posix()})"
    write_block(Path(a.doc), f"privacy-audit:{setting}", block)
    return text


def plot(board: dict[str, dict[str, Any]], front: dict[str, list[str]], cells: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    L.accuracy_panel(axes[0], board, front, "attack_auc", "membership attack AUC, strongest attack (0.5: chance)",
                     log=False)
    axes[0].legend(fontsize=7, loc="center right")
    plot_distances(cells, axes[1])
    fig.suptitle(f"{title}: mean ± std over seeds; filled: on the Pareto front")
    fig.tight_layout()
    save_png(fig, path)


# ---- the command --------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    shared = common_args(dataset="digit-styles", seeds="0,1,2", set=[], out="docs/results/privacy_audit",
                         runs="runs/privacy_audit", threads=1,
                         helps={"set": "run-config overrides for every classification cell"})
    p = argparse.ArgumentParser(prog=prog("privacy-audit"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, parents=[shared])
    p.add_argument("--scale", default="tiny", choices=SCALES,
                   help="tiny: the leaderboard's cells shrunk by TINY and the generation cells by GENERATIVE_TINY; "
                        "leaderboard: the leaderboard's cells as they are, the generation cells at their tables' "
                        "settings (PFDM's 8 px table, DCFM's table)")
    p.add_argument("--partitioner", default="domain", choices=sorted(L.SETTINGS))
    p.add_argument("--alpha", type=float, default=0.1, help="the Dirichlet concentration (--partitioner dirichlet)")
    p.add_argument("--entries", default=",".join(DEFAULT_ENTRIES),
                   help=f"leaderboard entries to audit, a subset of {','.join(L.ENTRIES)} ('' for none)")
    p.add_argument("--generative", default=",".join(GENERATIVE),
                   help=f"generation cells to audit, a subset of {','.join(GENERATIVE)} ('' for none)")
    p.add_argument("--no-controls", action="store_true", help="skip the overfitted-classifier controls")
    p.add_argument("--cap", type=int, default=200, help="members (and as many non-members) per client at most")
    p.add_argument("--shadows", type=int, default=4,
                   help="shadow models per client of the likelihood-ratio attack on model uploads (0: none)")
    p.add_argument("--overfit-epochs", type=int, default=60, help="local epochs of the overfitted control")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples of each figure's interval")
    p.add_argument("--doc", default="docs/privacy.md", help="the page the setting's tables are written into")
    p.add_argument("--no-run", action="store_true",
                   help="run and attack nothing: write the page from the cells on disk")
    return p


def check_numbers(a: argparse.Namespace) -> None:
    for name, low in (("cap", 2), ("shadows", 0), ("overfit_epochs", 1), ("resamples", 2)):
        value = getattr(a, name)
        if value < low or (name == "shadows" and value == 1):
            raise SystemExit(f"--{name.replace('_', '-')}={value}: must be at least {low}"
                             + (" and not 1 (a likelihood ratio needs two shadows)" if name == "shadows" else ""))


def plan_cells(a: argparse.Namespace, entries: list[str], gens: list[str], seeds: list[int]) -> list[tuple]:
    """(entry, seed, run config, clients) seed by seed: the leaderboard entries, the controls (on the FedAvg
    cell's run: its data and classifier), the generation cells."""
    clients = L.SETTINGS[a.partitioner]["clients"]
    plan = []
    for s in seeds:
        plan += [(e, s, classify_config(a, e, s), clients) for e in entries]
        if not a.no_controls:
            plan.append((CONTROL_OVERFIT, s, classify_config(a, "FedAvg", s), clients))
        plan += [(e, s, generative_config(a, e, s), GEN_CLIENTS) for e in gens]
    return plan


def attack_cell(entry: str, seed: int, flat: dict[str, Any], clients: int,
                settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """entry -> figures of one planned cell (the controls' item gives both controls), with the CPU seconds this
    process spent running the cell (0 when its run folder was there already) and attacking it."""
    import time

    t0 = time.process_time()
    folder = ensure_run(flat, clients)
    t1 = time.process_time()
    if entry == CONTROL_OVERFIT:
        got = controls(T.RunView.load(folder), settings, seed)
    else:
        figs = audit_run(folder, settings, seed)
        if entry in L.ENTRIES:
            figs["leaderboard"] = L.run_figures(flat, json.loads((folder / "summary.json").read_text()))
            figs["accuracy"] = figs["leaderboard"]["accuracy"]
        got = {entry: figs}
    cpu = {"run": t1 - t0, "attack": time.process_time() - t1}
    return {name: {**figs, "cpu_seconds": cpu} for name, figs in got.items()}


def main(argv: list[str]) -> None:
    a = parser().parse_args(argv)
    pin_threads(a.threads)
    check_numbers(a)
    with config_errors_exit():
        entries = subset_of("entries", a.entries, L.ENTRIES) if a.entries else []
        gens = subset_of("generative", a.generative, GENERATIVE) if a.generative else []
        seeds = L.parse_seeds(a.seeds)
        plan = plan_cells(a, entries, gens, seeds)
    quiet_logs()
    settings, cells_dir = audit_settings(a), Path(a.out) / "cells"
    setting = f"{L.setting_name(a)}-{a.scale}"
    cells: dict[str, dict[str, dict[str, Any]]] = {}
    failed: dict[str, str] = {}
    for entry, seed, flat, clients in plan:
        names = (CONTROL_OVERFIT, CONTROL_SAME) if entry == CONTROL_OVERFIT else (entry,)
        facts = {**settings, "control": CONTROL_TRAINING} if entry == CONTROL_OVERFIT else settings
        paths = {n: cell_file(cells_dir, f"{L.slug(n)}-s{seed}", flat, facts) for n in names}
        if all(p.is_file() for p in paths.values()):
            for n, p in paths.items():
                cells.setdefault(n, {})[str(seed)] = json.loads(p.read_text())["figures"]
            continue
        if a.no_run:
            continue
        print(f"cell {entry}, seed {seed}", flush=True)
        try:
            got = attack_cell(entry, seed, flat, clients, settings)
        except Exception as err:  # noqa: BLE001 - one cell's failure is reported; the other cells go on
            failed[f"{entry}, seed {seed}"] = f"{type(err).__name__}: {err}"
            print(f"cell {entry}, seed {seed} failed: {failed[f'{entry}, seed {seed}']}", flush=True)
            continue
        for n, figs in got.items():
            atomic_write_json(paths[n], {"entry": n, "seed": seed, "config": flat, "figures": figs})
            cells.setdefault(n, {})[str(seed)] = figs
            best = strongest(figs)
            print(f"cell {n}, seed {seed}: strongest attack {best['attack']} AUC {best['auc']:.3f} "
                  f"[{best['low']:.3f}, {best['high']:.3f}]", flush=True)
        write_outputs(a, argv, setting, order(cells), failed)
    print(write_outputs(a, argv, setting, order(cells), failed), flush=True)


def order(cells: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Leaderboard entries first (its order), then the generation cells, then the controls."""
    rank = [*L.ENTRIES, *GENERATIVE, CONTROL_OVERFIT, CONTROL_SAME]
    cells = {e: by for e, by in cells.items() if by}
    return {e: dict(sorted(cells[e].items(), key=lambda kv: int(kv[0])))
            for e in sorted(cells, key=lambda e: rank.index(e) if e in rank else len(rank))}
