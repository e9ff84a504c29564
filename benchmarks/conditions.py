"""Espresso's condition learning: the batched learner against the per-condition loop, same run, same draws.

    python benchmarks/conditions.py [--classes 10] [--per-class 16] [--clusters 4] [--steps 20]
        [--batch 1] [--threads 1]

A client like the default `flwr run .` (digit-styles, 16 images per class, J = 4: 40 conditions of ~4
images) on the tiny prior's architecture with random weights (timing does not depend on the weights).
It times production's `learn_conditions` (every condition's rows in one UNet call per step) and
`learn_conditions_loop` (one condition at a time, the same draws) for --steps Adam steps, checks that
they return the same embeddings, and times the learner before batching too
(`learn_conditions_minibatch`: one minibatch of 32 images over the whole client per step, 100 steps
at lr 0.01 its default; both research learners live in experiments/espresso_condition_learners.py), to
put the new default (200 steps, one image per condition) in seconds per client pass.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.espresso import learn_conditions
from experiments.cli import common_args, pin_threads
from experiments.espresso_condition_learners import learn_conditions_loop, learn_conditions_minibatch
from fedapp.models.prior.tiny import TinyPriorConfig, random_tiny_prior


def timed(fn, *args, **kw) -> tuple[torch.Tensor, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[common_args(threads=1)])
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=16)
    p.add_argument("--clusters", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="Adam steps timed (seconds scale linearly with steps)")
    p.add_argument("--batch", type=int, default=1, help="images per condition per step (espresso.embed-batch)")
    a = p.parse_args()
    pin_threads(a.threads)
    prior = random_tiny_prior(TinyPriorConfig(), dataset="digit-styles")
    n = a.classes * a.per_class
    z0 = torch.randn(n, *prior.latent_shape, generator=torch.Generator().manual_seed(0))
    owner = torch.arange(n) * (a.classes * a.clusters) // n  # equal clusters of per-class / clusters images
    e = int(owner.max()) + 1
    init = prior.encode_prompts(["a photo of the digit three"] * e).float()
    kw = {"steps": a.steps, "lr": 0.05, "batch": a.batch, "seed": 0}
    print(f"tiny prior architecture, RANDOM weights (timing only): {n} images, {e} conditions, {a.steps} steps, "
          f"{a.batch} image(s) per condition per step, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    batched, s_batched = timed(learn_conditions, prior, z0, owner, init, **kw)
    looped, s_loop = timed(learn_conditions_loop, prior, z0, owner, init, **kw)
    _, s_mixed = timed(learn_conditions_minibatch, prior, z0, owner, init, steps=a.steps, lr=0.01, batch=32, seed=0)
    diff = float((batched - looped).abs().max())
    print(f"{'learner':<34} {'rows/step':>9} {'s/step':>7} {'s (steps)':>9}")
    rows = {"batched (learn_conditions)": (min(a.batch, a.per_class // a.clusters) * e, s_batched),
            "per-condition loop": (min(a.batch, a.per_class // a.clusters) * e, s_loop),
            "mixed minibatch of 32 (before)": (32, s_mixed)}
    for name, (r, s) in rows.items():
        print(f"{name:<34} {r:>9} {s / a.steps:>7.3f} {s:>9.2f}")
    print(f"loop / batched time ratio: {s_loop / s_batched:.2f}x; max |batched - loop| = {diff:.2e}")
    print(f"condition learning per client pass: new default (200 steps) ~{200 * s_batched / a.steps:.0f} s, "
          f"before (100 steps of 32) ~{100 * s_mixed / a.steps:.0f} s, "
          f"the loop at 200 steps ~{200 * s_loop / a.steps:.0f} s")


if __name__ == "__main__":
    main()
