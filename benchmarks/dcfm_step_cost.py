"""What a DCFM training step costs with its CI term, against plain flow matching, at the 16 px table's size.

    python benchmarks/dcfm_step_cost.py [--steps 10] [--repeats 3] [--threads 1] [--ci-batch 16]

One velocity UNet (width 32, 16 px, 10 digits x 6 colours), batch 64, random data: the seconds of one
optimiser step of clients.dcfm.train_expert for plain L_FM (the baselines' experts, FedFlow), L_FM + L_CI
(DCFM's Stage I) and L_FM + L_peerCI against 4 frozen peers (variant A, 5 clients), each with the CI term on
the whole minibatch (dcfm.ci-batch = 0) and on --ci-batch of its samples; and of strategies.dcfm.distill_student
(variant B). Interleaved in one process, median of --repeats runs of --steps steps, printed as ratios against
plain L_FM measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.dcfm import train_expert  # noqa: E402
from experiments.cli import common_args, pin_threads  # noqa: E402
from fedapp.models.compose import build_velocity  # noqa: E402
from strategies.dcfm import distill_student  # noqa: E402

SIZE, BATCH, WIDTH, SIZES, PEERS = 16, 64, 32, [10, 6], 4


def data(n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.stack([torch.randint(0, k, (n,), generator=g) for k in SIZES], 1)
    return torch.rand(n, 3, SIZE, SIZE, generator=g) * 2 - 1, y


def cases(ci_batch: int) -> dict[str, dict]:
    """name -> train_expert keywords (None: the student)."""
    peers = {p: build_velocity(SIZE, SIZES, WIDTH).requires_grad_(False) for p in range(1, PEERS + 1)}
    out = {"L_FM (baselines, FedFlow)": {"lambda_ci": 0.0}}
    for k in (0, ci_batch):
        tag = "whole batch" if k == 0 else f"ci-batch {k}"
        out[f"L_FM + L_CI, {tag} (Stage I)"] = {"lambda_ci": 1.0, "ci_batch": k}
        out[f"L_FM + L_peerCI, {tag} (A, {PEERS} peers)"] = {"lambda_ci": 1.0, "ci_batch": k, "peers": peers,
                                                             "self_index": 0}
        out[f"L_student + L_studentCI, {tag} (B)"] = {"student": True, "ci_batch": k}
    return out


def step_seconds(kw: dict, steps: int, x: torch.Tensor, y: torch.Tensor) -> float:
    torch.manual_seed(0)
    net = build_velocity(SIZE, SIZES, WIDTH)
    t0 = time.perf_counter()
    if kw.get("student"):
        buf = {"x": x, "t": torch.rand(len(x)), "y": y, "v": torch.randn_like(x)}
        distill_student(net, buf, steps=steps, batch=BATCH, lr=2e-3, pi=(1.0, 0.0, 0.0), lambda_ci=1.0, seed=0,
                        ci_batch=kw["ci_batch"])
    else:
        train_expert(net, x, y, steps=steps, batch=BATCH, lr=2e-3, pi=(1.0, 0.0, 0.0), seed=0, **kw)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[common_args(threads=1)])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ci-batch", type=int, default=16)
    a = ap.parse_args()
    pin_threads(a.threads)
    x, y = data()
    todo = cases(a.ci_batch)
    times: dict[str, list[float]] = {name: [] for name in todo}
    for _ in range(a.repeats):  # interleaved: a change in the machine's load falls on every case alike
        for name, kw in todo.items():
            times[name].append(step_seconds(kw, a.steps, x, y))
    base = statistics.median(times["L_FM (baselines, FedFlow)"])
    print(f"| step ({SIZE} px, batch {BATCH}, width {WIDTH}, {a.threads} thread) | s a step | × L_FM |")
    print("|---|---|---|")
    for name, ts in times.items():
        s = statistics.median(ts)
        print(f"| {name} | {s:.3f} | {s / base:.2f}× |")


if __name__ == "__main__":
    main()
