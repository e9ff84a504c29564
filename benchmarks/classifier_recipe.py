"""Training throughput of the classifier recipe (`cnn`) against the one before it (`cnn-gap`), same run.

    python benchmarks/classifier_recipe.py [--sizes 28 16] [--batches 16 64] [--steps 30] [--threads N]
    python benchmarks/classifier_recipe.py --models cnn resnet10 --sizes 28 --batches 16 --threads 1

One training step is forward, cross-entropy, backward and an SGD step (momentum 0.9) on random images of
the size given: throughput does not depend on the pixels. Prints images/s of each model and each model's
ratio to the first of --models (the baseline) per (size, batch); the median of --repeats timings of --steps
steps after a warm-up. The second command prices FedDifRC's paper backbone (ResNet-10) against the tables' CNN.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.cli import common_args, pin_threads  # noqa: E402
from fedapp.models.classifier import build_classifier  # noqa: E402

MODELS = ("cnn-gap", "cnn")  # the baseline first


def images_per_second(model: str, size: int, batch: int, steps: int, repeats: int) -> float:
    torch.manual_seed(0)
    net = build_classifier(model, 10).train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))

    def step() -> None:
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        times.append(time.perf_counter() - t0)
    return steps * batch / statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                parents=[common_args(threads=torch.get_num_threads())])
    p.add_argument("--sizes", type=int, nargs="+", default=[28, 16])
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", nargs="+", default=list(MODELS), help="built-in classifiers; the first is the baseline")
    a = p.parse_args()
    pin_threads(a.threads)
    base, models = a.models[0], a.models
    params = {m: sum(t.numel() for t in build_classifier(m, 10).parameters()) for m in models}
    print("parameters: " + ", ".join(f"{m} {n:,}" for m, n in params.items()) + f"; {a.threads} threads")
    print("| size | batch | " + " | ".join(f"{m} img/s" for m in models) + " | "
          + " | ".join(f"{m} / {base}" for m in models[1:]) + " |")
    print("|---|---|" + "---|" * (2 * len(models) - 1))
    for size in a.sizes:
        for batch in a.batches:
            ips = {m: images_per_second(m, size, batch, a.steps, a.repeats) for m in models}
            print(f"| {size} | {batch} | " + " | ".join(f"{ips[m]:.0f}" for m in models) + " | "
                  + " | ".join(f"{ips[m] / ips[base]:.2f}" for m in models[1:]) + " |", flush=True)


if __name__ == "__main__":
    main()
