"""`python -m experiments pfdm-budget`: the denoiser budget at which PFDM's table is read.

centralized-ddpm, the table's oracle, on the table's data (experiments/pfdm.py's config: colored-mnist, the
minority partitioner, 4 clients, every client's shard pooled), trained in one continuous run to the last of
--steps (optimiser and EMA carried through; sweeps written before this was so trained in legs, each leg
restarting Adam from the previous leg's weights, and their setups lack "continuous"); at each checkpoint
its class-balanced samples (--samples, DDIM --sample-steps) are read by the table's reference classifier
(strategies.generation_eval: fedapp.readers' SmallCNN, width 16, --ref-epochs). A checkpoint converges when
its samples are read as the requested class >= 90 % (experiments.common.generative_verdict); the budget is
the first checkpoint at which every seed does, and counts only if the reader reads >= 97 % of held-out real
test images. The sweep's verdict also accepts a plateau (experiments.common.plateau: the reading moves < 1 point
and the loss < 5 % over the last 4,000 steps), a converged budget under the 90 % mark.
Writes <out>/pfdm_budget_<dataset>_<size>px[_uncond<p>][_ema<d>][_w<widths>].json and .png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experiments.cli import common_args, pin_threads
from experiments.common import (add_sweep_arguments, all_converged, budget_verdict, checkpoint_steps,
                                generative_verdict, prog, quiet_logs, run_sweep)


def pooled_data(flat: dict[str, Any], clients: int):
    """The oracle's training set (every client's shard: centralized-ddpm's data) and the server's split."""
    from fedapp.config import parse_run_config
    from fedapp.data import all_client_shards, server_data

    cfg = parse_run_config(flat)
    shards = all_client_shards(cfg, clients)
    return (torch.cat([s.train.x for s in shards]), torch.cat([s.train.y for s in shards]),
            server_data(cfg, clients), cfg)


def sweep_seed(a, seed: int, steps: list[int], progress=lambda points: None, partial: list | None = None,
               state: Any = None) -> dict[str, Any]:
    """One seed's curve: sample accuracy (and the mean loss of the last 10 % of steps) at every checkpoint.
    `state` (a TrainState): the run continues from its file where one is saved, keeping the readings of
    `partial` (the seed's checkpoints on disk) up to the step it continues from."""
    from experiments.pfdm import config, parser
    from fedapp.models.classifier import predict
    from fedapp.models.ddpm import build_ddpm, train_ddpm
    from fedapp.readers import server_reader
    from strategies.generation_eval import sample_model

    table_args = parser().parse_args(["--dataset", a.dataset, "--image-size", str(a.image_size),
                                      "--channels", a.channels, "--clients", str(a.clients)])
    x, y, server, cfg = pooled_data(config(table_args, "centralized-ddpm", seed), a.clients)
    reader = server_reader(server, seed, epochs=a.ref_epochs, width=16)
    torch.manual_seed(seed)
    model = build_ddpm(a.image_size, server.info.num_classes, channels=a.channels)
    done = state.saved_step() if state is not None else 0
    points, t_start = [q for q in (partial or []) if q["steps"] <= done], time.time()
    if done:
        print(f"seed {seed}: continuing from step {done} ({state.path})", flush=True)
    t_before = points[-1]["train_seconds"] if points else 0.0  # a state is saved right after a reading

    def read(step: int, m, loss: float) -> None:  # one checkpoint of the continuous run
        t_read = time.time()
        by_w, by_class = {}, {}
        for w in guidances(a):
            gen, gy = sample_model(m, a.samples, server.info.num_classes, a.sample_steps, seed + 1, w)
            hit = (predict(reader.model, gen) == gy).float()
            by_w[str(w)] = float(hit.mean())
            by_class[str(w)] = [float(hit[gy == c].mean()) for c in range(server.info.num_classes)]
        read_seconds.append(time.time() - t_read)
        best = max(by_w, key=by_w.get)
        t_train = t_before + time.time() - t_start - sum(read_seconds)
        # per class at the best scale: whether the classes the pooled data has least of are what holds it back
        points.append({"steps": step, "sample_accuracy": by_w[best], "guidance": float(best),
                       "sample_accuracy_by_guidance": by_w, "sample_accuracy_by_class": by_class[best],
                       "loss": loss, "train_seconds": round(t_train, 1)})
        shown = ", ".join(f"w={w}: {100 * v:.1f}%" for w, v in by_w.items())
        print(f"seed {seed} {step:6d} steps: samples read as requested {shown} (loss {loss:.4f}, "
              f"{t_train:.0f} s of training)", flush=True)
        progress(points)

    read_seconds: list[float] = []
    train_ddpm(model, x, y, steps=steps[-1], batch=a.batch, lr=a.lr, seed=seed * 100_003 + steps[-1],
               device=torch_device(a.device), p_uncond=a.p_uncond, ema=a.ema, checkpoints=steps,
               on_checkpoint=read, state=state)
    return {"train_images": len(x), "train_class_counts": torch.bincount(y, minlength=server.info.num_classes).tolist(),
            "reader_accuracy": reader.held_out_accuracy, "points": points,
            **({"resumed_from_step": done} if done else {})}


def torch_device(device: str) -> str:
    """--device as torch takes it: auto is CUDA where torch finds it (the run config's rule), else the CPU."""
    from fedapp.config import _check_device

    _check_device(device)  # one line naming the value and what is allowed
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def train_state(runs_dir: Path, path: Path, setup: dict[str, Any], seed: int):
    """A seed's TrainState file, named by the sweep and a digest of its setup (another setup gets another file)."""
    from fedapp.models.cache import facts_digest
    from fedapp.models.checkpoints import TrainState

    signature = {"setup": setup, "seed": seed}
    return TrainState(runs_dir / f"{path.stem}_s{seed}_{facts_digest(signature)}.pt", signature)


def guidances(a) -> list[float]:
    return [float(w) for w in a.guidance.split(",") if w]


def budget(seeds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The first checkpoint at which, at one guidance scale, every seed's samples are read >= 90 % (None:
    none), with that scale, and whether the readers behind it read >= 97 % of the real test images."""
    curves = [s["points"] for s in seeds.values()]
    reader_ok = all(s["reader_accuracy"] >= 0.97 for s in seeds.values())
    for i in range(min(map(len, curves))):
        by_w = [c[i].get("sample_accuracy_by_guidance", {"1.0": c[i]["sample_accuracy"]}) for c in curves]
        for w in by_w[0]:
            if all(generative_verdict(b.get(w))["converged"] for b in by_w):
                return {"steps": curves[0][i]["steps"], "guidance": float(w), "readers_reliable": reader_ok}
    return {"steps": None, "guidance": None, "readers_reliable": reader_ok}


def verdict(seeds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Has this recipe converged at its largest budget? Over seeds, at each seed's best guidance scale: its oracle
    reads >= 90 % at the last checkpoint, or its curve has plateaued (experiments.common.budget_verdict)."""
    return all_converged([budget_verdict(s["points"]) for s in seeds.values()])


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    for seed, s in result["seeds"].items():
        for w in s["points"][0].get("sample_accuracy_by_guidance", {"1.0": None}):
            acc = [p.get("sample_accuracy_by_guidance", {w: p["sample_accuracy"]})[w] for p in s["points"]]
            ax.plot([p["steps"] for p in s["points"]], [100 * v for v in acc], "o-",
                    label=f"seed {seed}, guidance {w} (reader {100 * s['reader_accuracy']:.1f}%)")
    ax.axhline(90, color="gray", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xticks([q["steps"] for q in next(iter(result["seeds"].values()))["points"]])
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.minorticks_off()
    ax.set_xlabel("centralized-ddpm training steps")
    ax.set_ylabel("samples read as requested (%)")
    st = result["setup"]
    ax.set_title(f"{st['dataset']} {st['image_size']} px, width {st['channels']}, "
                 f"label dropout {st.get('p_uncond', 0.0)}, EMA {st.get('ema', 0.0)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(seeds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Budget, verdict and the mean curve over seeds (at each seed's best guidance scale)."""
    checkpoints = [p["steps"] for p in next(iter(seeds.values()))["points"]]
    return {"budget": budget(seeds), "verdict": verdict(seeds),
            "mean_sample_accuracy": {str(st): float(np.mean([s["points"][i]["sample_accuracy"]
                                                             for s in seeds.values()]))
                                     for i, st in enumerate(checkpoints)}}


def main(argv: list[str]) -> None:
    shared = common_args(dataset="colored-mnist", seeds="0,1,2", out="docs/results", runs_dir="runs/pfdm-budget",
                         threads=1, helps={"runs_dir": "where each seed's training state is kept after every "
                                                       "checkpoint, so that a stopped sweep continues from its last "
                                                       "checkpoint"})
    p = argparse.ArgumentParser(prog=prog("pfdm-budget"), description=__doc__.split("\n")[0], parents=[shared])
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--steps", default="500,1000,2000,4000,8000", help="checkpoints (cumulative training steps)")
    p.add_argument("--channels", default="16,32")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--p-uncond", type=float, default=0.0,
                   help="label dropout for classifier-free guidance (0: none, the tables so far)")
    p.add_argument("--ema", type=float, default=0.0, help="EMA decay of the weights (0: none, the tables so far)")
    p.add_argument("--guidance", default="1", help="guidance scales to read at each checkpoint, e.g. 1,2,3")
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--sample-steps", type=int, default=40)
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N: where the "
                                                    "denoiser trains and samples (the readers stay on the CPU)")
    add_sweep_arguments(p)
    a = p.parse_args(argv)
    steps = checkpoint_steps(a.steps)
    pin_threads(a.threads)
    quiet_logs()
    out = Path(a.out)
    # a changed recipe's sweep is written beside the plain one
    recipe = (f"_uncond{a.p_uncond:g}" if a.p_uncond else "") + (f"_ema{a.ema:g}" if a.ema else "") + (
        f"_w{a.channels.replace(',', '-')}" if a.channels != "16,32" else "")
    path = out / f"pfdm_budget_{a.dataset}_{a.image_size}px{recipe}.json"
    where = ("seeds", "threads", "out", "runs_dir", "device")  # how and where it runs, not what it measures
    setup = {k: v for k, v in vars(a).items() if k not in where} | {"continuous": True}
    # options added later are kept out of the setup at their defaults, so that earlier sweeps still resume
    for key, default in (("p_uncond", 0.0), ("guidance", "1"), ("ema", 0.0)):
        if setup[key] == default:
            del setup[key]

    def measure(seed: int, progress, partial: list) -> dict[str, Any]:
        return sweep_seed(a, seed, steps, progress, partial, train_state(Path(a.runs_dir), path, setup, seed))

    result = run_sweep(path, setup, a.seeds, measure, summary)
    plot(result, path.with_suffix(".png"))
    print(f"budget: {result['budget']}")
