"""Sampling throughput of DDIM and Z-sampling against the bound set by the UNet alone.

    python benchmarks/sampling.py [--batches 64 256] [--steps 25] [--threads N]

Uses the tiny prior's architecture with random weights (timing does not depend on the weights).
For each batch size B it measures the seconds of one UNet call at B rows and at 2B rows (a guided
prediction batches both branches), then runs each sampler and counts its UNet calls by rows. The
bound is sum over calls of the measured seconds for that call size; the loop's overhead is what the
sampler spends beyond it (DDIM arithmetic, guidance mixing, text encoding, Python).

Then, at the default Espresso run's sizes (espresso.synth-batch images a sampler call, its sampler settings; the
server classifier's minibatch), each of bf16 autocast, channels-last and torch.compile (and their pairs) against
float32 in the same process: one guided UNet call, a whole guided DDIM and a whole default (Z-sampling) sample, and
one training step of the `cnn` classifier, timed round-robin so that load falls on every variant alike; each row's
ratio is float32's seconds over its own. The last columns say how far a variant's images move from float32's on the
same noise (the packaged digit-styles prior, when it is installed or can be). Without the compiled variants, whose
warm-up takes minutes on a CPU:

    python -c "import sys; sys.path[:0] = ['benchmarks']; import sampling; sampling.pin_threads(1);
               sampling.variants_table(5, compiled=False)"
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.cli import common_args, pin_threads  # noqa: E402
from fedapp.models import precision  # noqa: E402
from fedapp.models.classifier import build_classifier  # noqa: E402
from fedapp.models.prior.samplers import DEFAULT_GUIDANCE, SamplerSettings, expected_unet_evals  # noqa: E402
from fedapp.models.prior.tiny import TinyPriorConfig, random_tiny_prior  # noqa: E402
from fedapp.plan.counts import SERVER_BATCH  # noqa: E402
from fedapp.protocols.espresso import EspressoOptions  # noqa: E402


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


# ---- precision, memory layout and torch.compile at the default run's sizes ---------------------------------
# name -> (bf16 autocast, channels-last, torch.compile); float32 first: every ratio is against it
VARIANTS = {"fp32": (False, False, False), "bf16": (True, False, False), "channels-last": (False, True, False),
            "channels-last+bf16": (True, True, False), "compile": (False, False, True),
            "compile+bf16": (True, False, True)}


def variant_settings(sampler: str, bf16: bool) -> SamplerSettings:
    """The default Espresso run's sampler settings (guidance resolved to the tiny prior's), or its DDIM twin."""
    base = dataclasses.replace(EspressoOptions(), gamma1=DEFAULT_GUIDANCE).sampler_settings()
    return dataclasses.replace(base, sampler=sampler, precision="bf16" if bf16 else "fp32")


def variant_prior(prior, channels_last: bool, compiled: bool):
    """`prior` with its UNet in channels-last and/or compiled (the same weights: one prior object per variant)."""
    prior = copy.copy(prior)
    unet = copy.deepcopy(prior.unet)
    if channels_last:
        unet = unet.to(memory_format=torch.channels_last)
    prior.unet = torch.compile(unet) if compiled else unet
    return prior


def variant_noise(rows: int, channels_last: bool, shape) -> torch.Tensor:
    z = torch.randn(rows, *shape, generator=torch.Generator().manual_seed(0))
    return z.contiguous(memory_format=torch.channels_last) if channels_last else z


def unet_call(prior, z: torch.Tensor, cond: torch.Tensor, bf16: bool) -> None:
    """One UNet call as the sampler makes it (Prior._eps: a timestep per row), so a compiled UNet reuses its graph."""
    with torch.no_grad(), precision.autocast("bf16" if bf16 else "fp32", "cpu"):
        prior._eps(z, 500, cond)


def classifier_step(parts, x: torch.Tensor, y: torch.Tensor, bf16: bool) -> None:
    """One step of the server classifier's training (fedapp.models.classifier.train_classifier's body)."""
    net, opt = parts
    with precision.autocast("bf16" if bf16 else "fp32", "cpu"):
        loss = torch.nn.functional.cross_entropy(net(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def classifier_parts(channels_last: bool, compiled: bool, image_size: int):
    torch.manual_seed(0)
    net = build_classifier("cnn", 10)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    return (torch.compile(net) if compiled else net), opt


def round_robin(jobs: dict, repeats: int) -> dict[str, float]:
    """name -> median seconds of `jobs[name]()`, the variants taking turns each repeat."""
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(repeats):
        for name, job in jobs.items():
            t0 = time.perf_counter()
            job()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def trained_prior():
    """The packaged digit-styles prior (what the default run samples from), or None where it cannot load."""
    try:
        from fedapp.models.prior import load_or_build_prior, tiny_prior_missing

        if tiny_prior_missing("tiny", "digit-styles"):
            return None
        return load_or_build_prior("tiny", "digit-styles", "cpu")
    except Exception as err:  # noqa: BLE001 -- the deviation columns are optional; timing goes on
        print(f"(no trained prior for the deviation columns: {err})")
        return None


def image_deviation(prior, settings: SamplerSettings, variant: str, batch: int) -> tuple[float, float] | None:
    """(mean, max) |pixel difference| in [-1, 1] between a variant's images and float32's from the same noise and
    class prompts; None for the compiled variants (each would compile the trained UNet once more)."""
    bf16, channels_last, compiled = VARIANTS[variant]
    if compiled:
        return None
    labels = torch.arange(batch) % 10
    cond = prior.encode_prompts([f"a photo of the digit {d}" for d in range(10)])[labels]
    noise = torch.randn(batch, *prior.latent_shape, generator=torch.Generator().manual_seed(1))
    ref = prior.sample(noise, cond, dataclasses.replace(settings, precision="fp32")).images
    mine = variant_prior(prior, channels_last, False)
    out = mine.sample(noise.contiguous(memory_format=torch.channels_last) if channels_last else noise, cond,
                      dataclasses.replace(settings, precision="bf16" if bf16 else "fp32")).images
    diff = (out.float() - ref.float()).abs()
    return float(diff.mean()), float(diff.max())


def variants_table(repeats: int, compiled: bool = True) -> None:
    """The variants at the default run's sizes, as ratios against float32 measured in this process. A compiled
    variant is timed on the call, DDIM (guided calls only, one graph) and the step; the default sampler's inversion
    calls take another batch size, which compiles again (not measured). compiled=False leaves the compiled variants
    out (their warm-up takes minutes on a CPU)."""
    opts = EspressoOptions()
    batch, rows = opts.synth_batch, 2 * opts.synth_batch  # a guided call batches both branches
    base = random_tiny_prior(TinyPriorConfig())
    size = base.image_size
    cond = base.null_condition(rows)
    x, y = torch.randn(SERVER_BATCH, 3, size, size), torch.randint(0, 10, (SERVER_BATCH,))
    print(f"\nvariants at the default run's sizes: a guided UNet call on {rows} rows, a whole sample of {batch} "
          f"images ({opts.steps} {opts.spacing} steps), a `cnn` training step at batch {SERVER_BATCH} ({size} px); "
          f"native bf16 on this CPU: {precision.cpu_has_native_bf16()}", flush=True)
    calls, ddim, default, steps, first = {}, {}, {}, {}, {}
    variants = {name: v for name, v in VARIANTS.items() if compiled or not v[2]}
    for name, (bf16, cl, comp) in variants.items():
        p = variant_prior(base, cl, comp)
        z = variant_noise(rows, cl, base.latent_shape)
        xb = x.contiguous(memory_format=torch.channels_last) if cl else x
        parts = classifier_parts(cl, comp, size)
        calls[name] = lambda p=p, z=z, b=bf16: unet_call(p, z, cond, b)
        ddim[name] = lambda p=p, b=bf16, c=cl: p.sample(variant_noise(batch, c, base.latent_shape), "a photo of the "
                                                         "digit three", variant_settings("ddim", b))
        if not comp:
            default[name] = lambda p=p, b=bf16, c=cl: p.sample(variant_noise(batch, c, base.latent_shape),
                                                                "a photo of the digit three",
                                                                variant_settings(opts.sampler, b))
        steps[name] = lambda parts=parts, xb=xb, b=bf16: classifier_step(parts, xb, y, b)
        t0 = time.perf_counter()  # warm-up: compiles the compiled variants
        calls[name](), ddim[name](), steps[name](), steps[name]()
        first[name] = time.perf_counter() - t0
        print(f"  {name}: warm-up {first[name]:.1f} s", flush=True)
    call_s, step_s = round_robin(calls, repeats), round_robin(steps, 3 * repeats)
    ddim_s, default_s = round_robin(ddim, max(2, repeats // 2)), round_robin(default, max(2, repeats // 2))
    trained = trained_prior()
    header = (f"{'variant':>18} {'warm-up s':>9} {'UNet call s':>11} {'x':>5} {'DDIM s':>7} {'x':>5} "
              f"{'default s':>9} {'x':>5} {'cnn step s':>10} {'x':>5} {'mean|d|':>8} {'max|d|':>7}")
    print(header)
    print("-" * len(header))
    for name in variants:
        dev = image_deviation(trained, variant_settings(opts.sampler, False), name, batch) if trained else None
        dev_text = f"{dev[0]:>8.4f} {dev[1]:>7.3f}" if dev else f"{'-':>8} {'-':>7}"
        dflt = (f"{default_s[name]:>9.2f} {default_s['fp32'] / default_s[name]:>5.2f}" if name in default_s
                else f"{'-':>9} {'-':>5}")
        print(f"{name:>18} {first[name]:>9.1f} {call_s[name]:>11.3f} {call_s['fp32'] / call_s[name]:>5.2f} "
              f"{ddim_s[name]:>7.2f} {ddim_s['fp32'] / ddim_s[name]:>5.2f} {dflt} {step_s[name]:>10.4f} "
              f"{step_s['fp32'] / step_s[name]:>5.2f} {dev_text}")
    print("x: float32's seconds over the variant's (> 1: faster); warm-up: the first call, DDIM sample and two steps "
          "(torch.compile compiles there); default: espresso's sampler (Z-sampling); |d|: pixel difference in "
          "[-1, 1] from float32's images, same noise, on the trained prior with the default sampler")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[common_args(threads=0)])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--guidance", type=float, default=DEFAULT_GUIDANCE)
    p.add_argument("--gamma2", type=float, default=0.0)
    p.add_argument("--zigzag-t", type=int, default=800)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    pin_threads(a.threads)
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
    variants_table(a.repeats)


if __name__ == "__main__":
    main()
