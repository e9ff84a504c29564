"""`python -m experiments dcfm-budget`: the step budget of DCFM's velocity nets.

One velocity net (the table's architecture, experiments/dcfm.py's data: colored-mnist, attribute hold-out,
5 clients) trained by plain masked flow matching (clients/dcfm.train_expert, lambda_ci = 0 unless given) in
one continuous run, read at each of --steps: the mean L_FM of the last 10 % of steps, and its samples of the
pairs it trained on (--samples-per-pair each, Euler --sample-steps) read by the table's digit and colour
readers (fedapp.readers, held-out accuracy printed). --train pooled is FedFlow's limit (every client's shard:
the seen pairs of the split); --train client<k> is one Stage-I expert on its own shard. A checkpoint converges
when its seen-pair composition accuracy is >= 90 % (experiments.common.generative_verdict, the table's own
verdict); the budget is the first checkpoint at which every seed does. Writes
<out>/dcfm_budget_<dataset>_<size>px_<split>_<train>[_w<width>][_ci<lambda>].json and .png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from experiments.cli import common_args, pin_threads
from experiments.common import (add_sweep_arguments, all_converged, checkpoint_steps, generative_verdict, prog,
                                quiet_logs, run_sweep)

def training_data(a, seed: int):
    """(x, y) the net trains on, the pairs it saw, and the server split (readers, novel pairs)."""
    from experiments.dcfm import SETTINGS, config
    from fedapp.config import parse_run_config
    from fedapp.data import client_shard, server_data
    from fedapp.models.compose import attribute_labels, pair_counts
    from fedapp.protocols.dcfm import ATTRS, attribute_sizes

    settings = {**SETTINGS, "dataset": a.dataset, "image-size": a.image_size, "dcfm.width": a.width}
    cfg = parse_run_config(config("fedflow", {}, a.split, a.clients, settings, "runs", seed))
    ids = range(a.clients) if a.train == "pooled" else [int(a.train.removeprefix("client"))]
    shards = [client_shard(cfg, pid, a.clients) for pid in ids]
    x = torch.cat([s.train.x.float() for s in shards])
    y = torch.cat([attribute_labels(s.train, ATTRS) for s in shards])
    server = server_data(cfg, a.clients)
    sizes = attribute_sizes(server.info)
    seen = pair_counts(y, sizes).nonzero().tolist()
    return x, y, seen, server, sizes


def read_pairs(model, readers: dict, pairs: list[list[int]], a, seed: int) -> dict[str, float]:
    """Digit, colour and composition accuracy of the net's samples of `pairs`, as the readers see them."""
    from fedapp.metrics import composition_accuracy
    from fedapp.models.classifier import predict
    from fedapp.models.compose import generate, joint_field

    y = torch.tensor(pairs, dtype=torch.long).repeat_interleave(a.samples_per_pair, 0)
    x = generate(joint_field(model, y), (len(y), 3, a.image_size, a.image_size), a.sample_steps, seed)
    digit, color = (predict(readers[n].model, x) for n in ("digit", "color"))
    return {"composition_accuracy": composition_accuracy(digit, color, y[:, 0], y[:, 1]),
            "digit_accuracy": float((digit == y[:, 0]).float().mean()),
            "color_accuracy": float((color == y[:, 1]).float().mean())}


def result_path(a: argparse.Namespace) -> Path:
    """The sweep's JSON, named by every choice that moves its figures beyond the defaults (a run with L_CI
    must not resume, or overwrite, the plain L_FM sweep of the same expert)."""
    width = f"_w{a.width}" if a.width != 32 else ""
    ci = f"_ci{a.lambda_ci:g}" if a.lambda_ci else ""
    return Path(a.out) / f"dcfm_budget_{a.dataset}_{a.image_size}px_{a.split}_{a.train}{width}{ci}.json"


def sweep_seed(a, seed: int, steps: list[int], progress=lambda points: None) -> dict[str, Any]:
    from clients.dcfm import train_expert
    from fedapp.models.compose import build_velocity
    from fedapp.protocols.dcfm import ATTRS
    from fedapp.readers import server_reader

    x, y, seen, server, sizes = training_data(a, seed)
    readers = {n: server_reader(server, seed + i, n, epochs=a.ref_epochs) for i, n in enumerate(ATTRS)}
    torch.manual_seed(seed)
    model = build_velocity(a.image_size, sizes, a.width, server.info.channels)
    points, t_start, read_seconds = [], time.time(), []

    def read(step: int, m, loss: float) -> None:
        t_read = time.time()
        figures = read_pairs(m, readers, seen, a, seed + 1)
        read_seconds.append(time.time() - t_read)
        t_train = time.time() - t_start - sum(read_seconds)
        points.append({"steps": step, "loss_fm": loss, **{f"seen_{k}": v for k, v in figures.items()},
                       "train_seconds": round(t_train, 1)})
        print(f"seed {seed} {step:6d} steps: L_FM {loss:.4f}, seen pairs read as requested "
              f"{100 * figures['composition_accuracy']:.1f}% (digit {100 * figures['digit_accuracy']:.1f}%, "
              f"colour {100 * figures['color_accuracy']:.1f}%), {t_train:.0f} s of training", flush=True)
        progress(points)

    train_expert(model, x, y, steps=steps[-1], batch=a.batch, lr=a.lr, pi=(1.0, 0.0, 0.0),
                 lambda_ci=a.lambda_ci, ci_batch=a.ci_batch, seed=seed * 100_003 + steps[-1], checkpoints=steps,
                 on_checkpoint=read)
    return {"train_images": len(x), "seen_pairs": len(seen),
            "reader_accuracy": {n: r.held_out_accuracy for n, r in readers.items()}, "points": points}


def budget(seeds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The first checkpoint at which every seed's seen-pair samples are read >= 90 % as requested (None:
    none), and whether the readers behind it are reliable (digit >= 97 %, colour >= 99 % held out)."""
    curves = [s["points"] for s in seeds.values()]
    from fedapp.readers import DEFAULT_THRESHOLD, THRESHOLDS

    reliable = all(acc >= THRESHOLDS.get(n, DEFAULT_THRESHOLD) for s in seeds.values()
                   for n, acc in s["reader_accuracy"].items())
    for i in range(min(map(len, curves))):
        if all(generative_verdict(c[i]["seen_composition_accuracy"])["converged"] for c in curves):
            return {"steps": curves[0][i]["steps"], "readers_reliable": reliable}
    return {"steps": None, "readers_reliable": reliable}


def summary(seeds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Budget, and the verdict at the last checkpoint over seeds."""
    return {"budget": budget(seeds), "verdict": all_converged(
        [generative_verdict(s["points"][-1]["seen_composition_accuracy"]) for s in seeds.values()])}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for seed, s in result["seeds"].items():
        x = [p["steps"] for p in s["points"]]
        left.plot(x, [p["loss_fm"] for p in s["points"]], "o-", label=f"seed {seed}")
        for key, style in (("composition", "o-"), ("digit", "s--"), ("color", "^:")):
            right.plot(x, [100 * p[f"seen_{key}_accuracy"] for p in s["points"]], style,
                       label=f"seed {seed}, {key}")
    right.axhline(90, color="gray", ls="--", lw=1)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("Adam steps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    left.set_ylabel("L_FM (last 10 % of steps)")
    right.set_ylabel("seen-pair samples read as requested (%)")
    st = result["setup"]
    fig.suptitle(f"{st['dataset']} {st['image_size']} px, {st['split']}, {st['train']}, width {st['width']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    shared = common_args(dataset="colored-mnist", seeds="0", out="docs/results", threads=1)
    p = argparse.ArgumentParser(prog=prog("dcfm-budget"), description=__doc__.split("\n")[0], parents=[shared])
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--split", choices=("non-iid", "iid"), default="non-iid")
    p.add_argument("--train", default="pooled", help="pooled (FedFlow's limit) or client<k> (one Stage-I expert)")
    p.add_argument("--steps", default="1000,2000,4000,8000", help="checkpoints of one run (Adam steps)")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--lambda-ci", type=float, default=0.0, help="L_CI weight (0: plain masked L_FM, FedFlow's)")
    p.add_argument("--ci-batch", type=int, default=0,
                   help="samples of the minibatch the L_CI term is estimated on (0: all; dcfm.ci-batch)")
    p.add_argument("--samples-per-pair", type=int, default=30)
    p.add_argument("--sample-steps", type=int, default=16)
    add_sweep_arguments(p)
    return p


def main(argv: list[str]) -> None:
    a = parser().parse_args(argv)
    steps = checkpoint_steps(a.steps)
    if a.train != "pooled" and not (a.train.startswith("client") and a.train[6:].isdigit()
                                    and int(a.train[6:]) < a.clients):
        raise SystemExit(f"--train={a.train!r}: must be pooled or client<k> with k < --clients ({a.clients})")
    pin_threads(a.threads)
    quiet_logs()
    setup = {k: v for k, v in vars(a).items() if k not in ("seeds", "threads", "out")}
    path = result_path(a)
    result = run_sweep(path, setup, a.seeds, lambda seed, progress, partial: sweep_seed(a, seed, steps, progress),
                       summary)
    plot(result, path.with_suffix(".png"))
    print(f"budget: {result['budget']}; verdict at {steps[-1]} steps: {result['verdict']['reason']}")
