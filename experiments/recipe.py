"""`python -m experiments recipe`: why FedAvg sat at chance on 28 px MNIST, and the classifier recipe that fixed it.

Three parts, each over --seeds, written to <out>/recipe.json and <out>/recipe.png (--out defaults to docs/results):

1. diagnosis: the first epoch of a client's SGD (lr 0.02, momentum 0.9, batch 16: `clients.classify.local_train`)
   on the pooled mnist-5k client data, one factor of the old recipe changed at a time (input scaling, the
   normalisation layer, initialisation, optimiser, lr, batch, the pooling before the head); test accuracy after
   25, 50, 100 and 175 steps. A factor that moves the early steps off chance is the cause.
2. centralised: the recipe trained as the server trains (`train_classifier`: AdamW, cosine) on the whole client
   pool of mnist-5k, test accuracy per epoch, with its +-2 px shift augmentation and without.
3. federated: FedAvg through the app (`fedapp.simulation.simulate_in_process`, fraction-evaluate 0: the server's
   global test accuracy) on mnist-5k, 10 clients: IID with every client a round, and Dirichlet alpha = 0.5 with
   5 of 10 a round, `cnn` against `cnn-gap` (the old recipe) at the same seeds; and the Foundation setting on
   8x8 digits (4 clients, IID, 5 rounds).

The checks the issue asks for are computed from the curves and stored under "checks".
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from experiments.cli import common_args, pin_threads
from experiments.common import accuracy_curve, check_configs, prog, quiet_logs, run
from fedapp.results import atomic_write_json

STEPS = (25, 50, 100, 175)  # where the diagnosis reads test accuracy (175 steps = one epoch of the pool at batch 16)
CHANCE = 0.1
# One factor of the old recipe changed at a time; "recipe" is the new one (spatial head + GN's 32 groups).
FACTORS: dict[str, dict[str, Any]] = {
    "old": {},
    "inputs in [0, 1]": {"scale": "01"},
    "inputs standardised": {"scale": "std"},
    "no normalisation": {"model": {"groups": 0}},
    "GroupNorm 32 groups": {"model": {"groups": 32}},
    "Kaiming init": {"init": "kaiming"},
    "Adam 1e-3": {"opt": "adam", "lr": 1e-3},
    "lr 0.005": {"lr": 0.005},
    "batch 32": {"batch": 32},
    "4x4 spatial head": {"model": {"head": "spatial"}},
    "recipe": {"model": {"head": "spatial", "groups": 32}},
}
OLD_MODEL = {"head": "gap", "groups": 8}


def build(model_kw: dict[str, Any], init: str = "default"):
    """A SmallCNN with the old recipe's settings overridden by `model_kw` (groups 0: no normalisation layer)."""
    import torch
    from torch import nn

    from fedapp.models.classifier import SmallCNN

    kw = {**OLD_MODEL, **model_kw}
    groups = kw.pop("groups")
    net = SmallCNN(10, groups=max(groups, 1), **kw)
    if groups == 0:
        for m in net.modules():
            if isinstance(m, nn.Sequential):
                for i, layer in enumerate(m):
                    if isinstance(layer, nn.GroupNorm):
                        m[i] = nn.Identity()
    if init == "kaiming":
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                torch.nn.init.zeros_(m.bias)
    return net


def pooled_clients(dataset: str, clients: int, seed: int, image_size: int | None = None, train_only: bool = True):
    """Every client's training images (and, unless train_only, their test splits too) of an IID split."""
    import torch

    import feddata

    shards = [feddata.load_client_shard(dataset, "iid", {"per-class": 0}, seed, i, clients, image_size=image_size)
              for i in range(clients)]
    splits = [s.train for s in shards] + ([] if train_only else [s.test for s in shards])
    return torch.cat([s.x for s in splits]), torch.cat([s.y for s in splits])


def diagnose(seed: int, clients: int) -> dict[str, list[float]]:
    """Test accuracy after STEPS steps of one client epoch for every FACTORS row."""
    import torch
    from torch.nn import functional as F

    import feddata
    from fedapp.models.classifier import accuracy

    x, y = pooled_clients("mnist-5k", clients, seed)
    test = feddata.load_server_data("mnist-5k", "iid", {}, seed, clients).test
    out = {}
    for name, f in FACTORS.items():
        tx, ex = x, test.x
        if f.get("scale") == "01":
            tx, ex = (x + 1) / 2, (test.x + 1) / 2
        elif f.get("scale") == "std":
            mu, sd = x.mean(), x.std()
            tx, ex = (x - mu) / sd, (test.x - mu) / sd
        torch.manual_seed(seed)
        net = build(f.get("model", {}), f.get("init", "default"))
        lr, batch = f.get("lr", 0.02), f.get("batch", 16)
        opt = torch.optim.Adam(net.parameters(), lr=lr) if f.get("opt") == "adam" else \
            torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
        perm = torch.randperm(len(tx), generator=torch.Generator().manual_seed(seed))
        accs, step = [], 0
        net.train()
        while step < STEPS[-1]:
            idx = perm[(step * batch) % len(tx):][:batch]
            loss = F.cross_entropy(net(tx[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step in STEPS:
                accs.append(round(accuracy(net, ex, test.y), 4))
                net.train()
        out[name] = accs
    return out


def centralised(dataset: str, seed: int, epochs: int, shift: int) -> list[float]:
    """Test accuracy after each epoch of `train_classifier` (the recipe, images shifted by up to `shift` px)
    on the whole client pool (the clients' train and test splits), measured on the server's test split."""
    import torch

    import feddata
    from fedapp.models.classifier import accuracy, build_classifier, train_classifier

    x, y = pooled_clients(dataset, 10, seed, train_only=False)
    test = feddata.load_server_data(dataset, "iid", {}, seed, 10).test
    curve: list[float] = []
    torch.manual_seed(seed)
    train_classifier(build_classifier("cnn", 10), x, y, epochs=epochs, seed=seed, shift=shift,
                     on_epoch=lambda _, m: curve.append(round(accuracy(m, test.x, test.y), 4)))
    return curve


CENTRAL_KEYS = {2: "mnist-5k", 0: "mnist-5k, no shift"}  # by the augmentation's shift in px
FEDERATED = {  # name: (dataset, clients, rounds, run config)
    "mnist-5k iid": ("mnist-5k", 10, 10, {"partitioner": "iid", "fraction-train": 1.0}),
    "mnist-5k a0.5": ("mnist-5k", 10, 10, {"partitioner": "dirichlet", "partitioner.alpha": 0.5,
                                          "fraction-train": 0.5}),
    "digits iid": ("digits", 4, 5, {"partitioner": "iid"}),
}


def fed_config(name: str, model: str, seed: int, a: argparse.Namespace) -> dict[str, Any]:
    dataset, _, rounds, extra = FEDERATED[name]
    return {"method": "fedavg", "dataset": dataset, "model": model, "seed": seed, "num-server-rounds": rounds,
            "local-epochs": a.local_epochs, "lr": 0.02, "batch-size": 16, "partitioner.per-class": 0,
            "fraction-evaluate": 0.0, "min-clients": 2, "device": "cpu", "out-dir": a.runs,
            "run-name": f"{name.replace(' ', '-')}-{model}-s{seed}", **extra}


def federated(name: str, model: str, seed: int, a: argparse.Namespace) -> list[float]:
    return accuracy_curve(run(fed_config(name, model, seed, a), FEDERATED[name][1], "inprocess"))


def checks(res: dict[str, Any]) -> dict[str, Any]:
    """The issue's bars, from the stored curves (None where a part was not run)."""
    def cells(part: str, key: str) -> list[list[float]]:
        return list(res.get(part, {}).get(key, {}).values())

    central = cells("centralised", "mnist-5k")
    iid = cells("federated", "mnist-5k iid/cnn")
    a05 = cells("federated", "mnist-5k a0.5/cnn")
    fed = [c for k, v in res.get("federated", {}).items() if k.endswith("/cnn") for c in v.values()]
    return {
        "centralised_final_min": min(c[-1] for c in central) if central else None,
        "centralised_ge_98": all(c[-1] >= 0.98 for c in central) if central else None,
        "fedavg_iid_best_within_10_rounds_min": min(max(c[:10]) for c in iid) if iid else None,
        "fedavg_iid_ge_95_within_10_rounds": all(max(c[:10]) >= 0.95 for c in iid) if iid else None,
        "fedavg_a05_round3_min": min(c[2] for c in a05) if a05 else None,
        "fedavg_a05_round3_gt_50": all(c[2] > 0.5 for c in a05) if a05 else None,
        "no_seed_at_chance_after_round_2": all(abs(v - CHANCE) > 1e-9 for c in fed for v in c[2:]) if fed else None,
    }


def verdicts(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each cell's convergence verdict over its seeds (experiments.common.classification_verdict on every
    seed's curve): the centralised epochs and the federated rounds. The federated runs stop at 10 rounds, so
    their verdict is "too short": the recipe's bars are about early learning; where FedAvg converges at
    alpha 0.5 is docs/results/feddifrc_budget.json."""
    from experiments.common import all_converged, classification_verdict

    return {part: {key: all_converged([classification_verdict(c) for c in per_seed.values()])
                   for key, per_seed in res.get(part, {}).items()} for part in ("centralised", "federated")}


def paired(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Same-seed differences in points (experiments.common.paired_difference): the recipe against cnn-gap per
    federated setting at round 3 and at the last round; centralised, the shift against no shift at the end."""
    from experiments.common import paired_difference

    def at(per_seed: dict[str, list[float]], r: int) -> dict[str, float]:
        return {k: 100 * c[r] for k, c in per_seed.items()}

    fed, out = res.get("federated", {}), {}
    for key, per_seed in fed.items():
        name, model = key.rsplit("/", 1)
        base = fed.get(f"{name}/cnn-gap")
        if model != "cnn-gap" and base:
            out[f"{name}: cnn - cnn-gap"] = {label: paired_difference(at(per_seed, r), at(base, r), True)
                                             for label, r in (("round_3", 2), ("last_round", -1))}
    central = res.get("centralised", {})
    if all(k in central for k in CENTRAL_KEYS.values()):
        out["centralised: shift - no shift"] = {"last_epoch": paired_difference(
            at(central[CENTRAL_KEYS[2]], -1), at(central[CENTRAL_KEYS[0]], -1), True)}
    return out


def mean_std(values: list[float], scale: float = 100.0) -> str:
    return f"{scale * float(np.mean(values)):.1f} ± {scale * float(np.std(values)):.1f}"


def table_text(res: dict[str, Any]) -> str:
    """The markdown of docs/recipe.md: the diagnosis (accuracy % after STEPS steps), the centralised curve's end,
    FedAvg per round with the recipe's same-seed difference against cnn-gap (points, seeds favouring it)."""
    from experiments.common import paired_text

    diag = res.get("diagnosis", {}).get("all", {})
    lines = ["| factor changed (one at a time) | " + " | ".join(f"{s} steps" for s in STEPS) + " |",
             "|---|" + "---|" * len(STEPS)]
    for f in FACTORS:
        runs = [d[f] for d in diag.values() if f in d]
        if runs:
            lines.append(f"| {f} | " + " | ".join(mean_std([r[i] for r in runs]) for i in range(len(STEPS))) + " |")
    lines += ["", "| centralised, mnist-5k | epochs | final test accuracy % | best % |", "|---|---|---|---|"]
    for name, per_seed in res.get("centralised", {}).items():
        curves = list(per_seed.values())
        lines.append(f"| {name} | {len(curves[0])} | {mean_std([c[-1] for c in curves])} | "
                     f"{mean_std([max(c) for c in curves])} |")
    fed, pairs = res.get("federated", {}), paired(res)
    lines += ["", "| FedAvg | model | round 1 | round 2 | round 3 | round 5 | last round "
                  "| last − cnn-gap, same seeds |",
              "|---|---|---|---|---|---|---|---|"]
    for key, per_seed in fed.items():
        name, model = key.rsplit("/", 1)
        curves = list(per_seed.values())
        cols = [mean_std([c[r] for c in curves]) if min(map(len, curves)) > r else "—" for r in (0, 1, 2, 4)]
        cols.append(mean_std([c[-1] for c in curves]))
        vs = paired_text(pairs.get(f"{name}: cnn - cnn-gap", {}).get("last_round")) if model != "cnn-gap" else "—"
        lines.append(f"| {name} | {model} | " + " | ".join(cols) + f" | {vs} |")
    return "\n".join(lines)


def summarise(values: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    arr = 100 * np.array(values)
    return arr.mean(0), arr.std(0)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    for name, per_seed in res.get("diagnosis", {}).items():
        mean, std = summarise(list(per_seed.values()))
        style = {"lw": 2.5, "color": "k"} if name in ("recipe", "old") else {"lw": 1, "alpha": 0.8}
        ax.errorbar(STEPS, mean, yerr=std, label=name, capsize=2, ls="--" if name == "old" else "-", **style)
    ax.set(title="diagnosis: first client epoch, mnist-5k (28 px)", xlabel="SGD steps (batch 16)",
           ylabel="test accuracy (%)")
    ax.legend(fontsize=7)
    ax = axes[1]
    for name, per_seed in res.get("centralised", {}).items():
        mean, std = summarise(list(per_seed.values()))
        x = np.arange(1, len(mean) + 1)
        ax.plot(x, mean, label=name)
        ax.fill_between(x, mean - std, mean + std, alpha=0.2)
    ax.axhline(98, color="grey", ls=":")
    ax.set(title="centralised (AdamW, cosine), recipe", xlabel="epoch", ylim=(80, 100))
    ax.legend(fontsize=8)
    ax = axes[2]
    for name, per_seed in res.get("federated", {}).items():
        mean, std = summarise(list(per_seed.values()))
        x = np.arange(1, len(mean) + 1)
        ax.plot(x, mean, label=name, ls="--" if name.endswith("cnn-gap") else "-")
        ax.fill_between(x, mean - std, mean + std, alpha=0.2)
    ax.axhline(100 * CHANCE, color="grey", ls=":")
    ax.set(title="FedAvg (server test accuracy), cnn vs cnn-gap", xlabel="round")
    ax.legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    n = len(next(iter(res.get("diagnosis", {}).values()), {}))
    fig.suptitle(f"classifier recipe, mean ± std over {n} seeds (python -m experiments recipe)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(res: dict[str, Any], part: str, key: str, seed: int, fn: Callable[[], Any],
            save: Callable[[], None]) -> None:
    """One resumable cell: skipped when the json already holds it."""
    cell = res.setdefault(part, {}).setdefault(key, {})
    if str(seed) in cell:
        return
    t = time.time()
    cell[str(seed)] = fn()
    print(f"{part:12s} {key:22s} seed {seed}: {cell[str(seed)]} ({time.time() - t:.0f} s)", flush=True)
    save()


def main(argv: list[str]) -> None:
    shared = common_args(seeds="0,1,2", out="docs/results", runs="runs/recipe", threads=2,
                         helps={"threads": "torch threads (one job at a time)"})
    p = argparse.ArgumentParser(prog=prog("recipe"), description=__doc__.split("\n")[0], parents=[shared])
    p.add_argument("--parts", default="diagnosis,centralised,federated")
    p.add_argument("--epochs", type=int, default=20, help="centralised epochs")
    p.add_argument("--local-epochs", type=int, default=2, help="FedAvg's local epochs a round")
    p.add_argument("--clients", type=int, default=10, help="clients of the diagnosis' pooled data")
    p.add_argument("--fresh", action="store_true", help="ignore cells already in <out>/recipe.json")
    a = p.parse_args(argv)
    pin_threads(a.threads)
    quiet_logs()
    seeds, parts = [int(s) for s in a.seeds.split(",")], a.parts.split(",")
    setup = {"epochs": a.epochs, "local_epochs": a.local_epochs, "clients": a.clients}
    out = Path(a.out)
    json_path = out / "recipe.json"
    res: dict[str, Any] = {}
    if json_path.exists() and not a.fresh:
        old = json.loads(json_path.read_text())
        if old.get("setup") == setup:
            res = old["results"]
    check_configs([fed_config(n, m, seeds[0], a) for n in FEDERATED for m in ("cnn", "cnn-gap")], 10)

    def save() -> None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(json_path, {"setup": setup, "results": res, "checks": checks(res),
                                      "verdicts": verdicts(res), "paired": paired(res)})

    for seed in seeds:
        if "diagnosis" in parts:
            measure(res, "diagnosis", "all", seed, lambda: diagnose(seed, a.clients), save)
        if "centralised" in parts:
            for shift in (2, 0):
                measure(res, "centralised", CENTRAL_KEYS[shift], seed,
                        lambda: centralised("mnist-5k", seed, a.epochs, shift), save)
        if "federated" in parts:
            for name in FEDERATED:
                for model in ("cnn", "cnn-gap"):
                    measure(res, "federated", f"{name}/{model}", seed, lambda: federated(name, model, seed, a), save)
    # the diagnosis cell is stored per seed under "all"; reshape it to factor -> seed for the plot
    diag = res.get("diagnosis", {}).get("all", {})
    view = dict(res, diagnosis={f: {s: d[f] for s, d in diag.items()} for f in FACTORS
                                if all(f in d for d in diag.values())})
    save()
    plot(view, out / "recipe.png")
    print(table_text(res))
    print(json.dumps(checks(res), indent=1))
    print(f"wrote {json_path} and {out / 'recipe.png'}")
