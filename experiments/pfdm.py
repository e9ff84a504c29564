"""`python -m experiments pfdm`: PFDM against its baselines on colored-digits (minority partitioner).

Prints client 0's majority/minority/mean Frechet distance and KID (reference-classifier features, not
Inception) for centralized-ddpm, fedavg-ddpm, local-only, dpdm (DP-SGD at --epsilon) and pfdm, and the
attack figures, mean ± std over --seeds; writes <out>/pfdm[_<dataset>].json (every run, and the table,
the ε curve and the scaling as means over seeds), the first seed's per-client sample grids under
<out>/pfdm[_<dataset>]_grids/, <out>/..._eps_curve.png (client 0's KID against ε, --eps-curve, with the
baselines as references) and <out>/..._scaling.png (PFDM and its private model alone as the number of
clients grows, total data fixed: the pool is split over more clients). Results are written after every
run; a rerun under the same setup measures only what is missing, and a run stopped mid-training continues in
its folder (cell_run_name) from its denoisers' train states (pfdm.checkpoint-every). Two runners on disjoint
seeds share the json: each write merges the runs on disk under its lock. Every run goes through
`fedapp.simulation.simulate_in_process` (the default; --backend ray: `fedapp.simulate`, Flower's Ray
simulation) and its folder goes under --runs; --out defaults to docs/results. --doc PAGE.md writes the table
into that page's generated block; with --seeds "" nothing runs and the views are rewritten from the json.

Compute-matched rows: each row lists its denoiser optimiser steps and images seen (denoiser_compute), and
the oracle centralized-ddpm trains for the largest total of the other rows (oracle_steps: pfdm's
clients x pfdm.local-steps + pfdm.shared-steps at the defaults, 2,000 steps, where it trained 400 before),
set in config() as its pfdm.shared-steps, after any --set. The table's verdict (experiments.common.
generative_verdict): converged when every seed's centralized-ddpm samples are read as the requested class
>= 90% (its sample_accuracy); every row prints it. Paired seeds: pfdm (and each ablation row) against
local-only and against its own run's private model alone (private_only_*), client 0's mean Fréchet
distance, minority KID and minority class reading, per seed both have.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from experiments.cli import common_args
from experiments.common import (BACKENDS, all_converged, check_configs, count_text, file_lock, generative_verdict,
                                json_under, over_seeds, plateau,
                                paired_difference, paired_text, parse_set, prog, run, verdict_mark, write_block)
from fedapp.results import atomic_write_json

TABLE_METHODS = ("centralized-ddpm", "fedavg-ddpm", "local-only", "dpdm", "pfdm")
# Ablation rows (--methods): pfdm with one of its documented choices switched, each against the pfdm row
VARIANTS = {"pfdm-algorithm2": {"method": "pfdm", "pfdm.shared": "algorithm2"},
            "pfdm-private-all": {"method": "pfdm", "pfdm.private-levels": "all"}}
# A positive control for the attacks: a deliberately memorising, non-private model, so
# that "membership inference at chance" on the released models is evidence and not an attack without power:
# centralized-ddpm on 3 images per class per client, 4,000 steps (~1,300 epochs at batch 64 on 4 x ~24 images).
CONTROLS = {"memorising-ddpm": {"method": "centralized-ddpm", "partitioner.per-class": 3, "pfdm.shared-steps": 4000}}
PAPER = {  # C-MNIST, client 0, FID (majority / minority / mean) and MIA on the global model (%)
    "centralized-ddpm": (1.85, 1.45, 1.66), "fedavg-ddpm": (1.89, 1.51, 1.70),
    "local-only": (2.19, 5.99, 4.09), "pfdm": (1.72, 4.79, 3.26),
    "pfdm_mia": {"auc": 49.70, "asr": 50.10, "tpr_at_1fpr": 1.07},
    # MNIST, two clients, epsilon = 10: federated DPDM (DP-SGD) against PFDM, FID majority / minority / mean
    "mnist_2_clients_eps10": {"dpdm": (31.06, 36.40, 33.73), "pfdm": (5.40, 8.51, 6.96)},
}
KID_KEYS = tuple(f"{p}{g}_{k}" for p in ("", "private_only_") for g in ("majority", "minority")
                 for k in ("kid", "kid_std")) + ("mean_kid", "private_only_mean_kid")
KEEP = KID_KEYS + ("majority_distance", "minority_distance", "mean_distance", "sample_accuracy",
        "majority_sample_accuracy", "minority_sample_accuracy", "private_only_majority_sample_accuracy",
        "private_only_minority_sample_accuracy", "mia_auc",
        "mia_attack_accuracy", "mia_tpr_at_1fpr", "shared_memorised_fraction", "shared_nn_distance",
        "recon_true_distance", "recon_random_distance", "recon_closer_than_random", "recon_identified",
        "recon_identified_chance", "private_only_majority_distance", "private_only_minority_distance",
        "private_only_mean_distance", "private_only_sample_accuracy", "reference_accuracy", "reader_unreliable",
        "per_client",
        "dp_epsilon", "dp_noise_multiplier_max", "t0_kid", "t0_kid_std", "t0_kid_reference", "t0_kid_reference_std",
        "t0_energy_ratio", "t0_energy_ratio_reference", "t0_handover_ok",
        "private_only_per_client")


ORACLE = "centralized-ddpm"
FEDERATED = tuple(m for m in TABLE_METHODS if m != ORACLE) + tuple(VARIANTS)  # the rows the oracle must match
# client 0's figures of the paired differences -> whether higher is better; the minority classes' reading is
# the class reading of the images asked of client 0's rare classes
PAIRED_KEYS = {"mean_distance": False, "minority_kid": False, "minority_sample_accuracy": True}
PAIRED_POINTS = {"minority_sample_accuracy"}  # fractions: their differences print as points


def config(args, method: str, seed: int, epsilon: float | None = None) -> dict:
    """The run config of a table row at ε (default --epsilon): a method, a VARIANTS row (pfdm with one
    option switched) or a CONTROLS row, then --set; the oracle's pfdm.shared-steps is oracle_steps(args),
    whatever --set says."""
    flat = {"method": method, "dataset": args.dataset, "partitioner": "minority",
            "partitioner.per-class": 0, "image-size": args.image_size,
            "seed": seed, "out-dir": args.runs, "min-clients": 2, "num-server-rounds": args.rounds,
            "pfdm.local-steps": args.steps, "pfdm.shared-steps": args.steps, "pfdm.samples": args.samples,
            "pfdm.sample-steps": args.sample_steps, "pfdm.attack-samples": args.attack_samples,
            "pfdm.channels": args.channels, "pfdm.epsilon": args.epsilon,
            **VARIANTS.get(method, {}), **CONTROLS.get(method, {}),
            **eps_config(args.epsilon if epsilon is None else epsilon), **parse_set(args.set)}
    if method == ORACLE:
        flat["pfdm.shared-steps"] = oracle_steps(args)
    return flat


def denoiser_compute(flat: dict, clients: int) -> dict[str, int]:
    """A row's denoiser optimiser steps, summed over the models its output needs, and images seen = steps x
    pfdm.batch (fedapp.models.ddpm.train_ddpm draws pfdm.batch images a step, fewer only from a smaller set;
    dpdm's Poisson batches have that size in expectation): centralized-ddpm pfdm.shared-steps; fedavg-ddpm
    and dpdm clients x rounds x ceil(pfdm.local-steps / rounds); local-only clients x pfdm.local-steps;
    pfdm clients x pfdm.local-steps (private denoisers) + pfdm.shared-steps (z_w). Not counted: what only
    evaluates (pfdm's private-only reference model, the reference classifier, the attacks)."""
    from clients.ddpm_baselines import steps_per_round
    from fedapp.config import parse_run_config

    cfg = parse_run_config(flat)
    o, rounds = cfg.options, cfg.num_server_rounds
    steps = {"centralized-ddpm": o.shared_steps, "fedavg-ddpm": clients * rounds * steps_per_round(o, rounds),
             "local-only": clients * o.local_steps, "pfdm": clients * o.local_steps + o.shared_steps}
    steps["dpdm"] = steps["fedavg-ddpm"]
    return {"steps": steps[cfg.method], "images_seen": steps[cfg.method] * o.batch}


def oracle_steps(args) -> int:
    """The oracle's training steps: the largest total of the federated rows at the table's clients."""
    return max(denoiser_compute(config(args, m, 0), args.clients)["steps"] for m in FEDERATED)


def eps_key(epsilon: float):
    """ε as the json holds it: a number, or "inf" (strict JSON has no infinity)."""
    return "inf" if epsilon == float("inf") else float(epsilon)


def cell_run_name(method: str, clients: int, flat: dict) -> str:
    """A cell's run folder name: the same for the same row, clients and run config (where it writes and how
    often it saves left out), so that a stopped cell run again finds its folder and continues each denoiser
    from its newest train state there (pfdm.checkpoint-every, fedapp.models.checkpoints)."""
    from fedapp.models.cache import facts_digest
    from fedapp.models.checkpoints import STATE_FREE_KEYS

    facts = {k: v for k, v in flat.items() if k not in STATE_FREE_KEYS}
    return f"{method}-n{clients}-s{flat['seed']}-{facts_digest({**facts, 'clients': clients}, 10)}"


def run_one(args, method: str, clients: int, epsilon: float, seed: int) -> dict:
    from fedapp.models.checkpoints import STATE_DIR

    t = time.time()
    flat = config(args, method, seed, epsilon)
    flat["run-name"] = cell_run_name(method, clients, flat)
    continued = (Path(args.runs) / flat["run-name"] / STATE_DIR).is_dir()  # a stopped cell's train states
    if continued:
        print(f"{method} (N={clients}, seed {seed}): continuing from the train states in "
              f"{Path(args.runs) / flat['run-name'] / STATE_DIR}", flush=True)
    s = run(flat, clients, args.backend)
    row = {k: v for k, v in s["metrics"].items() if k in KEEP}
    row.update({"method": method, "clients": clients, "epsilon": eps_key(epsilon), "seed": seed,
                "t0": (s.get("privacy") or {}).get("t0"), "wall_seconds": round(time.time() - t, 1),
                "run_dir": s["run_dir"], "privacy": s.get("privacy"),
                "continued": continued})  # wall_seconds: this last part's only
    return row


def aggregate(rows: list[dict]) -> dict:
    """The runs of one cell (same method, clients and ε; one per seed): the mean of every numeric figure,
    `<key>_seed_std` its std over the seeds (ddof 0), the seeds, the summed wall time, the first run's rest."""
    first = rows[0]
    cell = {k: v for k, v in first.items() if not isinstance(v, (int, float)) or isinstance(v, bool)}
    cell.update(clients=first["clients"], epsilon=first["epsilon"], t0=first.get("t0"), seeds=[r["seed"] for r in rows],
                wall_seconds=round(sum(r["wall_seconds"] for r in rows), 1), run_dirs=[r["run_dir"] for r in rows])
    cell.update(over_seeds(rows, [k for k in dict.fromkeys(k for r in rows for k in r) if k in KEEP]))
    cell["reader_unreliable"] = any(r.get("reader_unreliable") for r in rows)  # any seed's reader below 97 %
    return cell


def copy_grids(row: dict, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for png in sorted((Path(row["run_dir"]) / "images").glob("*.png")):
        shutil.copy(png, dest / f"{row['method']}_n{row['clients']}_{png.name}")


def fmt(v, pct=False) -> str:
    if v is None:
        return "n/a"
    return f"{100 * v:.1f}" if pct else f"{v:.3f}"


def cell(r: dict, key: str, pct: bool = False) -> str:
    """mean, and ± the std over seeds where there are several; "(k of n seeds)" where only k of the cell's
    seeds report the figure (one added to the table after some seeds were measured)."""
    if r.get(key) is None:
        return "n/a"
    text = fmt(r[key], pct)
    runs = r.get(f"{key}_runs", len(r.get("seeds", [])))
    if runs > 1:
        text += f" ± {fmt(r[key + '_seed_std'], pct)}"
    if f"{key}_runs" in r:
        text += f" ({runs} of {len(r['seeds'])} seeds)"
    return text


def reader_lines(rows: list[dict]) -> list[str]:
    """One line when a row's reference classifier (fedapp.readers) read under 97 % of the held-out digits."""
    weak = [r["method"] for r in rows if r.get("reader_unreliable")]
    return [f"reader_unreliable: the reference classifier of {', '.join(weak)} reads < 97 % of held-out real "
            "images; its distances and sample accuracies are not to be trusted"] if weak else []


def verdict_text(verdict: dict[str, Any]) -> str:
    return verdict_mark(verdict) or "converged"


def print_table(rows: list[dict], verdict: dict[str, Any] | None = None, paired: list[dict] | None = None) -> str:
    """The table (every row with its steps, images seen and the table's verdict), the paired differences,
    z_w's hand-over figures."""
    verdict = verdict or all_converged([])
    lines = [f"verdict: {verdict_text(verdict)} ({ORACLE}, {verdict['converged_seeds']}/{verdict['seeds']} seeds "
             f"converged; {verdict['reason']})", *reader_lines(rows), "",
             ("| method | seeds | majority | minority | mean | KID majority | KID minority | sample acc % "
              "| minority acc % | MIA AUC % | MIA acc % | TPR@1%FPR % | memorised | paper FID (maj/min/mean) | steps "
              "| images seen | verdict |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = PAPER.get(r["method"])
        spent = f", DP-SGD ε={r['dp_epsilon']:.2f}" if r.get("dp_epsilon") else ""
        lines.append(f"| {r['method']} (N={r['clients']}{spent}) | {len(r['seeds'])} | "
                     f"{cell(r, 'majority_distance')} | "
                     f"{cell(r, 'minority_distance')} | {cell(r, 'mean_distance')} | {cell(r, 'majority_kid')} | "
                     f"{cell(r, 'minority_kid')} | {cell(r, 'sample_accuracy', True)} | "
                     f"{cell(r, 'minority_sample_accuracy', True)} | {cell(r, 'mia_auc', True)} | "
                     f"{cell(r, 'mia_attack_accuracy', True)} | {cell(r, 'mia_tpr_at_1fpr', True)} | "
                     f"{cell(r, 'shared_memorised_fraction')} | {'/'.join(map(str, p)) if p else ''} | "
                     f"{count_text(r.get('steps'))} | {count_text(r.get('images_seen'))} | {verdict_text(verdict)} |")
        if r["method"] == "pfdm" or r["method"] in VARIANTS:
            lines.append(f"| {r['method']}: private model alone (N={r['clients']}) | {len(r['seeds'])} | "
                         f"{cell(r, 'private_only_majority_distance')} | {cell(r, 'private_only_minority_distance')} | "
                         f"{cell(r, 'private_only_mean_distance')} | {cell(r, 'private_only_majority_kid')} | "
                         f"{cell(r, 'private_only_minority_kid')} | {cell(r, 'private_only_sample_accuracy', True)} "
                         f"| {cell(r, 'private_only_minority_sample_accuracy', True)} "
                         f"| | | | | | | | {verdict_text(verdict)} |")
    if paired:
        lines += ["", "| same seeds: row - reference | " + " | ".join(
                      f"{k}{' (points)' * (k in PAIRED_POINTS)} ({'higher' if higher else 'lower'} is better)"
                      for k, higher in PAIRED_KEYS.items()) + " |",
                  "|---|" + "---|" * len(PAIRED_KEYS)]
        lines += [f"| {q['method']} - {q['against']} | " + " | ".join(
                      paired_text(q.get(k), 1, 100) if k in PAIRED_POINTS else paired_text(q.get(k), 3)
                      for k in PAIRED_KEYS) + " |" for q in paired]
    lines += ["", "| z_w's hand-over at t0 | seeds | t0 | KID | KID, held-out reference | energy ratio "
                  "| energy ratio, reference | passes (share of seeds) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("t0_kid") is not None:
            lines.append(f"| {r['method']} (N={r['clients']}) | {len(r['seeds'])} | {r.get('t0')} | "
                         f"{cell(r, 't0_kid')} | "
                         f"{cell(r, 't0_kid_reference')} | {cell(r, 't0_energy_ratio')} | "
                         f"{cell(r, 't0_energy_ratio_reference')} | {cell(r, 't0_handover_ok')} |")
    text = "\n".join(lines)
    print(text)
    return text


def spread(r: dict, key: str) -> float:
    """An error bar: the std over seeds where there are several, else the figure's own (KID: over subsets)."""
    if len(r.get("seeds", [])) > 1:
        return r[key + "_seed_std"]
    return r.get(key + "_std", 0.0)


PLATEAU_BAND = 0.02  # an oracle seed counts as at the plateau when it reads within 2 points of the plateau's level


def oracle_verdict(run: dict, plateaus: list[dict[str, Any]]) -> dict[str, Any]:
    """One seed's oracle: its samples read as the requested class >= 90 %, or it was trained at least to where
    the same recipe's budget curve plateaued (`plateaus`: experiments.common.plateau of each budget seed) and
    reads within PLATEAU_BAND of that plateau's level, i.e. it sits on the plateau rather than below it."""
    v = generative_verdict(run.get("sample_accuracy"))
    reached = [p for p in plateaus if p["plateau"] and (run.get("steps") or 0) >= p["from_steps"]]
    if v["converged"] or not reached or run.get("sample_accuracy") is None:
        return v
    level = statistics.fmean(p["level"] for p in reached)
    on = abs(float(run["sample_accuracy"]) - level) <= PLATEAU_BAND
    return {**v, "converged": on,
            "reason": f"{v['reason']}; {'on' if on else 'off'} its budget curve's plateau ({100 * level:.1f}% from "
                      f"{min(p['from_steps'] for p in reached)} steps, +/- {100 * PLATEAU_BAND:g} points)"}


def table_verdict(runs: list[dict], plateaus: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """The table's verdict: every seed's oracle (centralized-ddpm) has converged (oracle_verdict)."""
    return all_converged([oracle_verdict(r, list(plateaus)) for r in runs])


def oracle_runs(args, by_cell: dict[tuple, list[dict]], epsilon) -> list[dict]:
    """The table's oracle seeds, each with the denoiser steps its config gave it (denoiser_compute): a run's
    row does not record them, and oracle_verdict needs them to tell an oracle on its recipe's plateau from
    one stopped short of it."""
    return [{**r, **denoiser_compute(config(args, ORACLE, r["seed"], float(epsilon)), args.clients)}
            for r in by_cell.get((ORACLE, args.clients, epsilon), [])]


def budget_plateaus(path: str) -> list[dict[str, Any]]:
    """The plateau of each seed of a pfdm-budget json (--plateau-from): the curve that says where the oracle's
    recipe stops improving."""
    if not path:
        return []
    seeds = json.loads(Path(path).read_text())["seeds"]
    return [plateau(s["points"]) for s in seeds.values()]


def paired_rows(by_cell: dict[tuple, list[dict]], clients: int, epsilon) -> list[dict]:
    """pfdm and each ablation row, same seeds, against local-only and against its own private model alone:
    PAIRED_KEYS' differences (experiments.common.paired_difference, each in its key's better direction)."""
    def per_seed(method: str, key: str) -> dict:
        return {r["seed"]: r.get(key) for r in by_cell.get((method, clients, epsilon), [])}

    out = []
    for m in ("pfdm", *VARIANTS):
        if (m, clients, epsilon) not in by_cell:
            continue
        for against, ref, prefix in (("local-only", "local-only", ""), ("its private model alone", m, "private_only_")):
            out.append({"method": m, "against": against, **{
                k: paired_difference(per_seed(m, k), per_seed(ref, prefix + k), higher_is_better=higher)
                for k, higher in PAIRED_KEYS.items()}})
    return out


def title_mark(verdict: dict[str, Any] | None) -> str:
    """"; not converged" after a plot's title when the table's verdict says so (none given: nothing)."""
    return f"; {verdict_mark(verdict)}" if verdict is not None and verdict_mark(verdict) else ""


def seeds_per_point(cells: list[dict]) -> str:
    """"3 seeds" or "1-3 seeds per point": what a plot's error bars stand on."""
    counts = sorted({len(c.get("seeds", [0])) for c in cells})
    return (f"{counts[0]} seed{'s' * (counts[0] > 1)}" if len(counts) == 1
            else f"{counts[0]}-{counts[-1]} seeds per point")


def plot_scaling(scaling: list[dict], path: Path, verdict: dict[str, Any] | None = None) -> None:
    """Client 0's minority KID and Frechet distance of PFDM and of its private model alone
    (non-collaborative) against the number of clients (total data fixed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scaling = sorted(scaling, key=lambda r: r["clients"])
    n = [r["clients"] for r in scaling]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.3))
    for ax, (key, name) in zip(axes, (("minority_kid", "KID"), ("minority_distance", "Frechet distance"))):
        ax.errorbar(n, [r[f"private_only_{key}"] for r in scaling],
                    yerr=[spread(r, f"private_only_{key}") for r in scaling], fmt="s-", capsize=3,
                    label="private model alone (non-collab.)")
        ax.errorbar(n, [r[key] for r in scaling], yerr=[spread(r, key) for r in scaling], fmt="o-", capsize=3,
                    label="PFDM (shared T→t0, private t0→0)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(c) for c in n])
        ax.set_xlabel("clients (total data fixed)")
        ax.set_ylabel(f"client 0 minority {name}")
        ax.legend(fontsize=7)
    fig.suptitle(f"minority classes of client 0 (reference-classifier features; {seeds_per_point(scaling)})"
                 f"{title_mark(verdict)}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)


EPS_CURVE = "1,3,10,30,100,inf"
SETUP_KEYS = ("clients", "steps", "rounds", "samples", "sample_steps", "attack_samples", "channels", "dataset",
              "image_size", "epsilon", "set")  # what every run depends on; a rerun under the same setup resumes


def table_setup(args: argparse.Namespace) -> dict[str, Any]:
    """What every run of the json depends on: a rerun under the same setup resumes its runs."""
    return {**{k: getattr(args, k) for k in SETUP_KEYS}, "set": setup_sets(args.set),
            "oracle_steps": oracle_steps(args)}


def doc_block(args: argparse.Namespace, stem: str) -> str:
    """The name of the page block the table goes into (--doc): one per dataset, image size and step budget."""
    return f"pfdm:{stem}-{args.image_size}px-{args.steps}"


def setup_sets(sets: list[str]) -> list[str]:
    """--set as the setup compares it: pfdm.checkpoint-every changes how often runs save, not what they give."""
    return [s for s in sets if s.split("=", 1)[0].strip() != "pfdm.checkpoint-every"]


def curve_epsilon(text: str) -> float:
    """An ε of the curve: a positive number or inf (t0 = 1, the least noise: no privacy to speak of)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--eps-curve value {text!r}: must be > 0 or inf")
    return value


def eps_config(epsilon: float) -> dict:
    """pfdm at ε: pfdm.epsilon picks t0 (pfdm.t0 = 0); ε = inf is the lowest level, t0 = 1."""
    if epsilon == float("inf"):
        return {"pfdm.t0": 1}
    return {"pfdm.epsilon": epsilon, "pfdm.t0": 0}


def plot_eps_curve(curve: list[dict], table: list[dict], path: Path, verdict: dict[str, Any] | None = None) -> None:
    """Client 0's minority and majority KID against ε, the non-collaborative and federated references as
    horizontal lines; ε = inf is drawn at the right edge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps = sorted(float(r["epsilon"]) for r in curve)
    curve = sorted(curve, key=lambda r: float(r["epsilon"]))
    finite = [e for e in eps if e != float("inf")]
    edge = max(finite) * 10 if finite else 1.0
    xs = [e if e != float("inf") else edge for e in eps]
    refs = {r["method"]: r for r in table}
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.4))
    for ax, group in zip(axes, ("minority", "majority")):
        key = f"{group}_kid"
        ax.errorbar(xs, [r[key] for r in curve], yerr=[spread(r, key) for r in curve], fmt="o-", capsize=3,
                    label="PFDM")
        ax.errorbar(xs, [r[f"private_only_{key}"] for r in curve],
                    yerr=[spread(r, f"private_only_{key}") for r in curve], fmt="s:", color="C1", capsize=3,
                    label="private model alone (its run)")
        for (name, style) in (("local-only", "--"), ("fedavg-ddpm", "-."), ("dpdm", ":")):
            if name in refs and key in refs[name]:
                ax.axhline(refs[name][key], ls=style, color="grey", lw=1, label=name)
        ax.set_xscale("log")
        ax.set_xticks(xs, [("∞" if e == float("inf") else f"{e:g}") + f"\nt0={r['t0']}" for e, r in zip(eps, curve)],
                      fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel("ε (LDP of an upload)")
        ax.set_ylabel(f"client 0 {group} KID")
        ax.set_title(f"{group} classes", fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"PFDM against ε ({seeds_per_point(curve)}; error bars: std over seeds, or KID's over subsets "
                 f"for one){title_mark(verdict)}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)


def parser() -> argparse.ArgumentParser:
    shared = common_args(dataset="colored-digits", seeds="0", set=[], runs="runs/pfdm-experiment", out="docs/results",
                         helps={"dataset": "a dataset with classes (colored-mnist: real digits)",
                                "seeds": "comma-separated run seeds: every run once per seed",
                                "set": "run-config overrides for every run",
                                "out": "folder for pfdm[_<dataset>].json, its grids and plots"})
    ap = argparse.ArgumentParser(prog=prog("pfdm"), description=__doc__.split("\n")[0], parents=[shared])
    ap.add_argument("--clients", type=int, default=4, help="clients of the main table and the ε curve")
    ap.add_argument("--scaling", default="2,4,8", help="client counts of the scaling plot (pfdm runs)")
    ap.add_argument("--eps-curve", default="",
                    help=f"ε values of the ε curve (pfdm runs at --clients), e.g. {EPS_CURVE}; inf = t0 of 1")
    ap.add_argument("--steps", type=int, default=400, help="pfdm.local-steps = pfdm.shared-steps")
    ap.add_argument("--plateau-from", default="", metavar="BUDGET_JSON",
                    help="a pfdm-budget json of the oracle's recipe: an oracle on its plateau counts as converged")
    ap.add_argument("--rounds", type=int, default=4, help="fedavg-ddpm rounds (local steps split over them)")
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--sample-steps", type=int, default=40)
    ap.add_argument("--attack-samples", type=int, default=300)
    ap.add_argument("--channels", default="16,32")
    ap.add_argument("--epsilon", type=float, default=10.0, help="ε of the table's pfdm and dpdm rows")
    ap.add_argument("--image-size", type=int, default=8)
    ap.add_argument("--methods", default=",".join(TABLE_METHODS),
                    help=f"table rows: methods, the ablation rows {', '.join(VARIANTS)} or the attacks' positive "
                         f"control {', '.join(CONTROLS)}")
    ap.add_argument("--doc", default=None, metavar="PAGE.md",
                    help="write the table into this page's generated block pfdm:<json stem>-<size>px-<steps> "
                         "(--seeds '' runs nothing and rewrites it from the json)")
    ap.add_argument("--backend", choices=BACKENDS, default="inprocess",
                    help="inprocess: fedapp.simulation.simulate_in_process (no Ray start-up); ray: fedapp.simulate")
    return ap


def main(argv: list[str]) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    scaling = [int(c) for c in args.scaling.split(",") if c]
    seeds = [int(x) for x in args.seeds.split(",") if x]
    try:
        eps_curve = [curve_epsilon(e) for e in args.eps_curve.split(",") if e]
    except argparse.ArgumentTypeError as err:
        ap.error(str(err))
    # (method, clients, ε) of every cell: the table at --epsilon, the ε curve, the scaling (at --epsilon)
    cells = [(m, args.clients, args.epsilon) for m in methods] + [("pfdm", args.clients, e) for e in eps_curve] \
        + [("pfdm", n, args.epsilon) for n in scaling]
    for method, clients, eps in dict.fromkeys(cells):
        check_configs([config(args, method, seeds[0] if seeds else 0, eps)], clients)
    docs = Path(args.out)
    docs.mkdir(parents=True, exist_ok=True)
    stem = "pfdm" if args.dataset == "colored-digits" else f"pfdm_{args.dataset}"
    path = docs / f"{stem}.json"
    setup = table_setup(args)
    result = {"setup": setup, "settings": vars(args), "paper": PAPER, "runs": []}
    done: dict[tuple, dict] = {}  # (method, clients, ε, seed) -> its run

    def read_runs() -> None:
        """Resume: the runs on disk measured under the same setup (another runner's too) join `done`."""
        for r in json_under(path, setup).get("runs", []):
            done.setdefault((r["method"], r["clients"], r["epsilon"], r["seed"]), r)

    def views() -> None:
        """Under the json's lock (two runners on disjoint seeds share it: each writes every run either has),
        the table, the ε curve and the scaling from every run of this setup (any invocation's seeds and
        cells): each cell the mean over the seeds it has (its `seeds` says which)."""
        with file_lock(path):
            read_runs()
            result["runs"] = list(done.values())
            write_views()

    def write_views() -> None:
        by_cell: dict[tuple, list[dict]] = {}
        for (method, clients, eps, _), row in sorted(done.items(), key=lambda kv: kv[0][3]):
            by_cell.setdefault((method, clients, eps), []).append(row)
        means = {k: aggregate(v) for k, v in by_cell.items()}
        for (method, clients, eps), c in means.items():
            c.update(denoiser_compute(config(args, method, 0, float(eps)), clients))
        here = eps_key(args.epsilon)
        result["verdict"] = table_verdict(oracle_runs(args, by_cell, here), budget_plateaus(args.plateau_from))
        result["paired"] = paired_rows(by_cell, args.clients, here)
        order = list(TABLE_METHODS) + list(VARIANTS) + list(CONTROLS)
        result["table"] = [means[m, args.clients, here] for m in order if (m, args.clients, here) in means]
        result["eps_curve"] = sorted((c for (m, n, _), c in means.items() if m == "pfdm" and n == args.clients),
                                     key=lambda c: float(c["epsilon"]))
        result["scaling"] = sorted((c for (m, _, e), c in means.items() if m == "pfdm" and e == here),
                                   key=lambda c: c["clients"])
        atomic_write_json(path, result)

    read_runs()
    for method, clients, eps in dict.fromkeys(cells):  # cell by cell: an interrupted table has whole cells first
        for seed in seeds:
            key = (method, clients, eps_key(eps), seed)
            if key not in done:
                done[key] = run_one(args, method, clients, eps, seed)
                if all(k[3] >= seed for k in done if k[:3] == key[:3]):  # the grids show a cell's lowest seed
                    copy_grids(done[key], docs / f"{stem}_grids")
                views()
    views()
    if result["table"]:
        result["table_markdown"] = print_table(result["table"], result["verdict"], result["paired"])
    if len(result["eps_curve"]) > 1:
        plot_eps_curve(result["eps_curve"], result["table"], docs / f"{stem}_eps_curve.png", result["verdict"])
        for r in result["eps_curve"]:
            print(f"eps={r['epsilon']} t0={r['t0']}: KID minority {cell(r, 'minority_kid')} (private alone "
                  f"{cell(r, 'private_only_minority_kid')}), majority {cell(r, 'majority_kid')}")
    if len(result["scaling"]) > 1:
        plot_scaling(result["scaling"], docs / f"{stem}_scaling.png", result["verdict"])
        for r in result["scaling"]:
            print(f"N={r['clients']}: KID minority pfdm {cell(r, 'minority_kid')}, private alone "
                  f"{cell(r, 'private_only_minority_kid')}")
    views()
    if args.doc:
        if not result["table"]:
            raise SystemExit(f"{path}: no runs under this setup (--steps {args.steps}, --image-size "
                             f"{args.image_size}, --channels {args.channels}, --set ...); give --seeds to run some")
        write_block(Path(args.doc), doc_block(args, stem), result["table_markdown"])
        print(f"wrote the table into {args.doc}")
