"""What a generation table costs at 28 px against the small images it was measured on.

    python benchmarks/table_cost.py [--repeats 5] [--threads 2]

For each method's backbone (PFDM's DDPM UNet, DCFM's velocity UNet, Espresso's tiny-prior UNet) it times
one training step (forward + backward at the tables' batch) or one guided sampler call (Espresso: a UNet
call on 2 x 64 rows), at the size its table was measured on and at 28 px, interleaved in one process
(median of --repeats), and prints the ratio. It then scales the wall time each 8/16 px table recorded in
docs/results/ by that ratio: a projection, not a measurement (fixed costs such as Ray start-up, data loading and
the reference classifiers do not grow with the image, so it errs high where they dominate).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.cli import common_args, pin_threads  # noqa: E402
from fedapp.models.compose import build_velocity  # noqa: E402
from fedapp.models.ddpm import build_ddpm  # noqa: E402
from fedapp.models.flow import fm_loss  # noqa: E402
from fedapp.models.prior.tiny import random_tiny_prior  # noqa: E402


def ddpm_step(size: int):
    model = build_ddpm(size, 10, flag=False, channels=(16, 32))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 3, size, size), torch.randint(0, 10, (64,))

    def step():
        opt.zero_grad()
        model.loss(x, y).backward()
        opt.step()
    return step


def velocity_step(size: int):
    net = build_velocity(size, [10, 6], 16)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x1, y = torch.randn(32, 3, size, size), torch.stack([torch.randint(0, 10, (32,)), torch.randint(0, 6, (32,))], 1)

    def step():
        opt.zero_grad()
        fm_loss(net, x1, y).backward()
        opt.step()
    return step


def prior_call(size: int):
    prior = random_tiny_prior(image_size=size)
    z, cond = torch.randn(128, *prior.latent_shape), prior.null_condition(128)

    def call():
        with torch.no_grad():
            prior.unet(z, 500, encoder_hidden_states=cond)
    return call


def seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def recorded_wall(name: str) -> tuple[float, str]:
    """Seconds of run time the small-image table in docs/results/ recorded, and what it covers."""
    docs = ROOT / "docs" / "results"
    if name == "pfdm":
        d = json.loads((docs / "pfdm.json").read_text())
        return sum(r["wall_seconds"] for r in d["runs"]), f"{len(d['runs'])} runs of docs/results/pfdm.json"
    if name == "dcfm":
        d = json.loads((docs / "dcfm.json").read_text())
        return sum(r["seconds"] for r in d["rows"]), f"{len(d['rows'])} runs of docs/results/dcfm.json (one seed)"
    return 46 * 60 / 3, "one seed of the espresso ablation (docs/espresso.md: 46 min for 3 seeds)"


BACKBONES = {"pfdm": (ddpm_step, 8, "DDPM UNet (16, 32), train step at batch 64"),
             "dcfm": (velocity_step, 8, "velocity UNet width 16, train step at batch 32"),
             "espresso": (prior_call, 16, "tiny-prior UNet, one guided call on 2 x 64 rows")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[common_args(threads=2)])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    pin_threads(a.threads)
    torch.manual_seed(0)
    print("| method | backbone | s at the table's size | s at 28 px | ratio | table's recorded run time "
          "| projected at 28 px |")
    print("|---|---|---|---|---|---|---|")
    for name, (build, small, what) in BACKBONES.items():
        s_small, s_28 = seconds(build(small), a.repeats), seconds(build(28), a.repeats)
        wall, covers = recorded_wall(name)
        ratio = s_28 / s_small
        print(f"| {name} | {what} | {s_small:.3f} ({small} px) | {s_28:.3f} | {ratio:.1f}× | {wall / 60:.0f} min "
              f"({covers}) | {ratio * wall / 3600:.1f} h |", flush=True)


if __name__ == "__main__":
    main()
