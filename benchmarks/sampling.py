"""Sampling throughput of DDIM and Z-sampling against the bound set by the UNet alone.

    python benchmarks/sampling.py [--batches 64 256] [--steps 25] [--threads N]

Uses the tiny prior's architecture with random weights (timing does not depend on the weights).
For each batch size B it measures the seconds of one UNet call at B rows and at 2B rows (a guided
prediction batches both branches), then runs each sampler and counts its UNet calls by rows. The
bound is sum over calls of the measured seconds for that call size; the loop's overhead is what the
sampler spends beyond it (DDIM arithmetic, guidance mixing, text encoding, Python).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedapp.models.prior.samplers import DEFAULT_GUIDANCE, SamplerSettings, expected_unet_evals  # noqa: E402
from fedapp.models.prior.tiny import TinyPriorConfig, random_tiny_prior  # noqa: E402


def time_call(prior, rows: int, repeats: int) -> float:
    z = torch.randn(rows, *prior.latent_shape)
    cond = prior.null_condition(rows)
    times = []
    with torch.no_grad():
        prior.unet(z, 500, encoder_hidden_states=cond)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            prior.unet(z, 500, encoder_hidden_states=cond)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_sampler(prior, batch: int, steps: int, sampler: str, guidance: float, gamma2: float, zigzag_t: int):
    calls: list[int] = []
    hook = prior.unet.register_forward_pre_hook(lambda _m, args: calls.append(args[0].shape[0]))
    try:
        noise = torch.randn(batch, *prior.latent_shape, generator=torch.Generator().manual_seed(0))
        t0 = time.perf_counter()
        out = prior.sample(noise, "a photo of the digit three",
                           SamplerSettings(sampler=sampler, num_steps=steps, guidance=guidance, zigzag_t=zigzag_t,
                                           gamma2=gamma2))
        seconds = time.perf_counter() - t0
    finally:
        hook.remove()
    return out, seconds, calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--guidance", type=float, default=DEFAULT_GUIDANCE)
    p.add_argument("--gamma2", type=float, default=0.0)
    p.add_argument("--zigzag-t", type=int, default=800)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    prior = random_tiny_prior(TinyPriorConfig())
    nparams = sum(q.numel() for q in prior.unet.parameters())
    print(f"tiny prior architecture, RANDOM weights (timing only): UNet {nparams / 1e6:.2f} M params, "
          f"{prior.latent_shape} pixels, {a.steps} steps, gamma1={a.guidance}, gamma2={a.gamma2}, T_z={a.zigzag_t}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    header = (f"{'batch':>5} {'sampler':>7} {'evals':>5} {'calls':>5} {'s/call B':>8} {'s/call 2B':>9} "
              f"{'bound s':>8} {'run s':>7} {'overhead':>8} {'img/s':>7} {'bound img/s':>11}")
    print(header)
    print("-" * len(header))
    for batch in a.batches:
        s_b, s_2b = time_call(prior, batch, a.repeats), time_call(prior, 2 * batch, a.repeats)
        per_rows = {batch: s_b, 2 * batch: s_2b}
        rows = {}
        for sampler in ("ddim", "zigzag"):
            out, seconds, calls = run_sampler(prior, batch, a.steps, sampler, a.guidance, a.gamma2, a.zigzag_t)
            expected = expected_unet_evals(a.steps, a.zigzag_t if sampler == "zigzag" else None, a.guidance, a.gamma2)
            assert out.unet_evals == expected, (out.unet_evals, expected)
            bound = sum(per_rows[c] for c in calls if c in per_rows)
            rows[sampler] = (out.unet_evals, seconds)
            print(f"{batch:>5} {sampler:>7} {out.unet_evals:>5} {len(calls):>5} {s_b:>8.4f} {s_2b:>9.4f} {bound:>8.2f} "
                  f"{seconds:>7.2f} {100 * (seconds / bound - 1):>7.1f}% "
                  f"{batch / seconds:>7.1f} {batch / bound:>11.1f}")
        (e_d, t_d), (e_z, t_z) = rows["ddim"], rows["zigzag"]
        print(f"{batch:>5} Z/DDIM  time ratio {t_z / t_d:.3f}  vs evaluation ratio {e_z / e_d:.3f}")
    print("evals: per-sample UNet evaluations (a guided pair counts 2); bound: sum of measured per-call seconds "
          "for the calls the sampler made; overhead = run / bound - 1.")


if __name__ == "__main__":
    main()
