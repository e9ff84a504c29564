"""What a table cell's mid-run train states cost against the training they protect.

    python benchmarks/train_state_cost.py [--steps 60] [--every 10] [--repeats 2] [--threads 1]

On the reduced PFDM table's denoiser (the wide UNet (32, 64) at 16 px, a private denoiser's flag, batch 64,
EMA 0.999, label dropout 0.1: docs/pfdm.md), in one process: train_ddpm for --steps steps without a train state
and with one saved every --every steps (fedapp.models.checkpoints.TrainState: weights, EMA, Adam, step, RNGs,
written atomically), interleaved --repeats times; and the save alone, timed apart. It prints, in wall and in
CPU seconds, a step and a save, the measured slowdown of the saving runs against the plain ones, and the overhead
of a save every pfdm.checkpoint-every steps: one save's time over that many steps' (from the parts), and the
measured slowdown scaled to that interval.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.cli import common_args, pin_threads  # noqa: E402
from fedapp.models.checkpoints import TrainState  # noqa: E402
from fedapp.models.ddpm import build_ddpm, train_ddpm  # noqa: E402
from fedapp.protocols.pfdm import PFDMOptions  # noqa: E402


def train_seconds(x, y, flag, steps: int, state: TrainState | None) -> tuple[float, float]:
    """(wall, CPU) seconds of `steps` training steps: the CPU time of this process is what the other jobs on a
    shared machine do not stretch."""
    torch.manual_seed(0)
    model = build_ddpm(16, 10, flag=True, channels=(32, 64))
    t, c = time.perf_counter(), time.process_time()
    train_ddpm(model, x, y, flag, steps=steps, batch=64, ema=0.999, p_uncond=0.1, state=state)
    return time.perf_counter() - t, time.process_time() - c


def save_seconds(x, y, flag, folder: Path, saves: int) -> tuple[float, float, int]:
    """The median (wall, CPU) seconds of one TrainState.save of a trained denoiser's whole state, and the
    file's bytes."""
    state = TrainState(folder / "alone.pt", {"name": "alone"})
    train_seconds(x, y, flag, 1, state)  # a real state (Adam's moments filled) to save again
    model = build_ddpm(16, 10, flag=True, channels=(32, 64))
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    opt = torch.optim.Adam(model.parameters())
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    parts, g = {"model": model, "ema": ema, "optimizer": opt}, torch.Generator()
    extras = {"tail": [], "read": []}
    state.restore(parts, g, extras)
    wall, cpu = [], []
    for k in range(saves):
        t, c = time.perf_counter(), time.process_time()
        state.save(k + 1, parts, g, extras)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu), state.path.stat().st_size


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[common_args(threads=1)])
    ap.add_argument("--steps", type=int, default=60, help="steps of each timed training run")
    ap.add_argument("--every", type=int, default=10, help="the saving runs' interval (small: a visible cost)")
    ap.add_argument("--repeats", type=int, default=2, help="plain and saving runs, interleaved")
    a = ap.parse_args(argv)
    pin_threads(a.threads)
    default = PFDMOptions().checkpoint_every
    x, y = torch.randn(2000, 3, 16, 16).clamp(-1, 1), torch.arange(2000) % 10
    flag = torch.arange(2000) % 2
    plain, saving = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        train_seconds(x, y, flag, 3, None)  # warm-up
        for r in range(a.repeats):
            plain.append(train_seconds(x, y, flag, a.steps, None))
            state = TrainState(folder / f"run{r}.pt", {"name": f"run{r}"}, every=a.every)
            saving.append(train_seconds(x, y, flag, a.steps, state))
        save_wall, save_cpu, size = save_seconds(x, y, flag, folder, 10)
    saves = a.steps // a.every + (a.steps % a.every != 0)
    print(f"wide UNet (32, 64), 16 px, batch 64, {a.threads} thread(s); a train state {size / 2**20:.1f} MiB")
    for i, kind in enumerate(("wall", "CPU")):
        step = statistics.median(r[i] for r in plain) / a.steps
        save = (save_wall, save_cpu)[i]
        measured = statistics.median(r[i] for r in saving) / statistics.median(r[i] for r in plain) - 1
        print(f"{kind}: {step:.3f} s a step, {save * 1000:.0f} ms a save (median of 10); saving every {a.every} "
              f"steps ({saves} saves in {a.steps} steps): {100 * measured:+.2f} % against the plain runs (median "
              f"of {a.repeats} each; from the parts: {100 * saves * save / (a.steps * step):+.2f} %); at "
              f"pfdm.checkpoint-every = {default}: {100 * save / (default * step):.2f} % of the training time from "
              f"the parts, {100 * measured * a.steps / (saves * default):.2f} % from the measured slowdown")


if __name__ == "__main__":
    main()
