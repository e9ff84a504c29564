"""`python -m experiments pfdm`: PFDM against its baselines on colored-digits (minority partitioner).

Prints client 0's majority/minority/mean Frechet distance and KID (reference-classifier features, not
Inception) for centralized-ddpm, fedavg-ddpm, local-only, dpdm (DP-SGD at --epsilon) and pfdm, and the
attack figures; writes
<out>/pfdm.json, per-client sample grids under <out>/pfdm_grids/, and <out>/pfdm_scaling.png: client 0's
minority distance of the private model alone (non-collaborative) minus PFDM's, as the number of clients
grows (total data fixed: the pool is split over more clients). Results are written after every run.
Every run is a Ray simulation (`fedapp.simulate`; --backend inprocess: fedapp.simulation.simulate_in_process)
whose folder goes under --runs; --out defaults to docs.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from experiments.common import BACKENDS, check_configs, kid_cell, prog, run
from fedapp.results import atomic_write_json

TABLE_METHODS = ("centralized-ddpm", "fedavg-ddpm", "local-only", "dpdm", "pfdm")
PAPER = {  # C-MNIST, client 0, FID (majority / minority / mean) and MIA on the global model (%)
    "centralized-ddpm": (1.85, 1.45, 1.66), "fedavg-ddpm": (1.89, 1.51, 1.70),
    "local-only": (2.19, 5.99, 4.09), "pfdm": (1.72, 4.79, 3.26),
    "pfdm_mia": {"auc": 49.70, "asr": 50.10, "tpr_at_1fpr": 1.07},
    # MNIST, two clients, epsilon = 10: federated DPDM (DP-SGD) against PFDM, FID majority / minority / mean
    "mnist_2_clients_eps10": {"dpdm": (31.06, 36.40, 33.73), "pfdm": (5.40, 8.51, 6.96)},
}
KID_KEYS = tuple(f"{p}{g}_{k}" for p in ("", "private_only_") for g in ("majority", "minority")
                 for k in ("kid", "kid_std")) + ("mean_kid", "private_only_mean_kid")
KEEP = KID_KEYS + ("majority_distance", "minority_distance", "mean_distance", "sample_accuracy", "mia_auc",
        "mia_attack_accuracy", "mia_tpr_at_1fpr", "shared_memorised_fraction", "shared_nn_distance",
        "recon_true_distance", "recon_random_distance", "recon_closer_than_random", "recon_identified",
        "recon_identified_chance", "private_only_majority_distance", "private_only_minority_distance",
        "private_only_mean_distance", "private_only_sample_accuracy", "reference_accuracy", "per_client",
        "dp_epsilon", "dp_noise_multiplier_max", "t0_kid", "t0_kid_std", "t0_kid_reference", "t0_kid_reference_std",
        "private_only_per_client")


def config(args, method: str) -> dict:
    return {"method": method, "dataset": args.dataset, "partitioner": "minority", "partitioner.per-class": 0,
            "image-size": args.image_size,
            "seed": args.seed, "out-dir": args.runs, "min-clients": 2, "num-server-rounds": args.rounds,
            "pfdm.local-steps": args.steps, "pfdm.shared-steps": args.steps, "pfdm.samples": args.samples,
            "pfdm.sample-steps": args.sample_steps, "pfdm.attack-samples": args.attack_samples,
            "pfdm.channels": args.channels, "pfdm.epsilon": args.epsilon}


def run_one(args, method: str, clients: int) -> dict:
    t = time.time()
    s = run(config(args, method), clients, args.backend)
    row = {k: v for k, v in s["metrics"].items() if k in KEEP}
    row.update({"method": method, "clients": clients, "wall_seconds": round(time.time() - t, 1),
                "run_dir": s["run_dir"], "privacy": s.get("privacy")})
    return row


def copy_grids(row: dict, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for png in sorted((Path(row["run_dir"]) / "images").glob("*.png")):
        shutil.copy(png, dest / f"{row['method']}_n{row['clients']}_{png.name}")


def fmt(v, pct=False) -> str:
    if v is None:
        return "n/a"
    return f"{100 * v:.1f}" if pct else f"{v:.3f}"


def print_table(rows: list[dict]) -> str:
    lines = ["| method | majority | minority | mean | KID majority | KID minority | sample acc | MIA AUC % | MIA acc % | TPR@1%FPR % | memorised | paper FID (maj/min/mean) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = PAPER.get(r["method"])
        spent = f", DP-SGD ε={r['dp_epsilon']:.2f}" if r.get("dp_epsilon") else ""
        lines.append(f"| {r['method']} (N={r['clients']}{spent}) | {fmt(r['majority_distance'])} | {fmt(r['minority_distance'])} | "
                     f"{fmt(r['mean_distance'])} | {kid_cell(r, 'majority_kid')} | {kid_cell(r, 'minority_kid')} | "
                     f"{fmt(r.get('sample_accuracy'), True)} | {fmt(r.get('mia_auc'), True)} | "
                     f"{fmt(r.get('mia_attack_accuracy'), True)} | {fmt(r.get('mia_tpr_at_1fpr'), True)} | "
                     f"{fmt(r.get('shared_memorised_fraction'))} | {'/'.join(map(str, p)) if p else ''} |")
        if r["method"] == "pfdm":
            lines.append(f"| pfdm: private model alone (N={r['clients']}) | {fmt(r['private_only_majority_distance'])} | "
                         f"{fmt(r['private_only_minority_distance'])} | {fmt(r['private_only_mean_distance'])} | "
                         f"{kid_cell(r, 'private_only_majority_kid')} | {kid_cell(r, 'private_only_minority_kid')} | "
                         f"{fmt(r.get('private_only_sample_accuracy'), True)} | | | | | |")
    text = "\n".join(lines)
    print(text)
    return text


def plot_scaling(scaling: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scaling = sorted(scaling, key=lambda r: r["clients"])
    n = [r["clients"] for r in scaling]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.3))
    a.plot(n, [r["private_only_minority_distance"] for r in scaling], "s-", label="private model alone (non-collab.)")
    a.plot(n, [r["minority_distance"] for r in scaling], "o-", label="PFDM (shared T→t0, private t0→0)")
    a.set_xscale("log", base=2); a.set_xlabel("clients (total data fixed)"); a.set_ylabel("client 0 minority distance")
    a.legend(fontsize=7)
    b.plot(n, [r["private_only_minority_distance"] - r["minority_distance"] for r in scaling], "o-", color="C2")
    b.axhline(0, color="grey", lw=0.8)
    b.set_xscale("log", base=2); b.set_xlabel("clients"); b.set_ylabel("gap: non-collab. − PFDM\n(> 0: PFDM better)")
    fig.suptitle("minority classes of client 0 (Frechet distance on SmallCNN features)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog=prog("pfdm"), description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=4, help="clients of the main table")
    ap.add_argument("--scaling", default="2,4,8", help="client counts of the scaling plot (pfdm runs)")
    ap.add_argument("--steps", type=int, default=400, help="pfdm.local-steps = pfdm.shared-steps")
    ap.add_argument("--rounds", type=int, default=4, help="fedavg-ddpm rounds (local steps split over them)")
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--sample-steps", type=int, default=40)
    ap.add_argument("--attack-samples", type=int, default=300)
    ap.add_argument("--channels", default="16,32")
    ap.add_argument("--epsilon", type=float, default=10.0)
    ap.add_argument("--dataset", default="colored-digits", help="a dataset with classes (colored-mnist: real digits)")
    ap.add_argument("--image-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=",".join(TABLE_METHODS))
    ap.add_argument("--runs", default="runs/pfdm-experiment", help="folder of the runs' own folders")
    ap.add_argument("--out", default="docs", help="folder for pfdm.json, pfdm_grids/ and pfdm_scaling.png")
    ap.add_argument("--backend", choices=BACKENDS, default="ray",
                    help="ray: fedapp.simulate; inprocess: fedapp.simulation.simulate_in_process (no Ray start-up)")
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    scaling = [int(c) for c in args.scaling.split(",") if c]
    check_configs([config(args, m) for m in methods], args.clients)
    for n in scaling:
        check_configs([config(args, "pfdm")], n)
    docs = Path(args.out)
    docs.mkdir(parents=True, exist_ok=True)
    result = {"settings": vars(args), "paper": PAPER, "table": [], "scaling": []}

    def save():
        atomic_write_json(docs / "pfdm.json", result)

    for method in methods:
        row = run_one(args, method, args.clients)
        copy_grids(row, docs / "pfdm_grids")
        result["table"].append(row)
        save()
    result["table_markdown"] = print_table(result["table"])
    save()
    for n in scaling:
        done = [r for r in result["table"] if r["method"] == "pfdm" and r["clients"] == n]
        row = done[0] if done else run_one(args, "pfdm", n)
        result["scaling"].append(row)
        save()
    if result["scaling"]:
        plot_scaling(result["scaling"], docs / "pfdm_scaling.png")
        for r in sorted(result["scaling"], key=lambda r: r["clients"]):
            print(f"N={r['clients']}: minority private-only {r['private_only_minority_distance']:.3f} "
                  f"pfdm {r['minority_distance']:.3f} gap {r['private_only_minority_distance'] - r['minority_distance']:+.3f}")
    save()
