"""PFDM's hand-over at t0: `python -m experiments pfdm-handover [--trained-steps 300,1000,3000]`.

Does z_w deliver, at level t0, the marginal the private models expect (a real release of the data)? Scored
by strategies.pfdm.t0_match_figures: the energy ratio of z_w's level-t0 samples to a real release (test
images clipped and diffused to t0) and their KID against it, beside five releases of held-out (public)
images; it passes at energy 1.00 +- 0.05 and a KID within 3 reference stds.

Two parts, both for pfdm.shared in {relative, algorithm2} and every pfdm.handover (ddim, bounded, ancestral):
1. exact: z_w = the exact denoiser of a diagonal Gaussian fitted to the data's clipped images (relative) or
   to their uploads (algorithm2): what unlimited training converges to on Gaussian-like data, so what it
   scores is the sampler's own error; at the DDIM steps the clients use (fedapp.models.ddpm.split_steps of
   pfdm.sample-steps) and at more.
2. trained: z_w trained on releases of the training images (the union of uploads, as PFDMStrategy does)
   for each of `--trained-steps`, scored the same way: the sampler's and the network's error together.

Writes <out>/pfdm_handover.json and prints one table per part.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch

from experiments.cli import common_args, pin_threads
from experiments.common import prog
from fedapp.models.ddpm import (DDPM, HANDOVERS, SHARED_MODES, build_ddpm, shared_objective, shared_sample,
                                split_steps, train_ddpm)
from fedapp.privacy import clip_norm, linear_abar, privatize, resolve_t0
from fedapp.results import atomic_write_json

REFERENCES = 5  # releases of held-out images: the reference KID's mean and spread


class GaussianDenoiser(DDPM):
    """The exact eps predictor of data N(mu, diag(s2)): E[eps | x_t] = sqrt(1 - a)(x_t - sqrt(a) mu) /
    (a s2 + 1 - a), a = abar_t (mu, s2: per-pixel tensors or numbers)."""

    def __init__(self, mu, s2, image_size: int = 8, channels: int = 3):
        super().__init__(image_size=image_size, channels=channels, block_out_channels=())
        self.mu, self.s2 = mu, s2

    def eps(self, x_t, t, y=None, flag=None):
        a = self.abar[t]
        return (1 - a).sqrt() * (x_t - a.sqrt() * self.mu) / (a * self.s2 + 1 - a)


def exact_denoiser(mode: str, x: torch.Tensor, clip: float, t0: int) -> GaussianDenoiser:
    """z_w's limit on data whose clipped images are N(mean, var) per pixel, as `mode` models them."""
    c = clip_norm(x, clip)
    mu, s2 = c.mean(0), c.var(0)
    size, channels = x.shape[-1], x.shape[1]
    if mode == "relative":  # the clean clipped images
        return GaussianDenoiser(mu, s2, size, channels)
    a0 = float(linear_abar()[t0])  # algorithm2: the uploads themselves
    return GaussianDenoiser(math.sqrt(a0) * mu, a0 * s2 + 1 - a0, size, channels)


def score(zw: DDPM, mode: str, handover: str, steps: int, t0: int, clip: float, y: torch.Tensor,
          real: torch.Tensor, held_out: list[torch.Tensor], seed: int) -> dict[str, Any]:
    from strategies.pfdm import t0_match_figures

    t = time.time()
    x = shared_sample(zw, y, t0, mode, steps, torch.Generator().manual_seed(seed + 1), handover, clip)
    seconds = time.time() - t
    return {**t0_match_figures(x, real, held_out, seed), "sample_seconds": round(seconds, 2)}


def load(dataset: str, image_size: int, seed: int, n_train: int):
    """Training images (the uploads' source), test images (the real release) and public images (held out)."""
    from feddata import load_client_shard, load_server_data

    shard = load_client_shard(dataset, "iid", {"per-class": 0}, seed, 0, 1, image_size=image_size)
    server = load_server_data(dataset, "iid", {}, seed, 1, image_size=image_size)
    return shard.train.subset(list(range(min(n_train, len(shard.train))))), server.test, server.public, shard.info


def table(rows: list[dict[str, Any]], title: str) -> str:
    lines = [f"### {title}", "", "| pfdm.shared | pfdm.handover | z_w steps | DDIM steps | energy ratio (ref.) "
             "| KID (ref. mean ± std) | passes | sampling s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['handover']} | {r.get('zw_steps', 'exact')} | "
                     f"{'every level' if r['handover'] == 'ancestral' else r['ddim_steps']} | "
                     f"{r['t0_energy_ratio']:.3f} ({r['t0_energy_ratio_reference']:.3f}) | "
                     f"{r['t0_kid']:.4f} ({r['t0_kid_reference']:.4f} ± {r['t0_kid_reference_std']:.4f}) | "
                     f"{'yes' if r['t0_handover_ok'] else 'no'} | {r['sample_seconds']} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    shared = common_args(dataset="colored-mnist", out="docs/results", threads=1)
    p = argparse.ArgumentParser(prog=prog("pfdm-handover"), description=__doc__.split("\n")[0], parents=[shared])
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--epsilon", type=float, default=10.0, help="t0 from the paper's bound, as pfdm.epsilon")
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--samples", type=int, default=200, help="z_w samples and real release size")
    p.add_argument("--sample-steps", type=int, default=50, help="pfdm.sample-steps (split at t0 as clients do)")
    p.add_argument("--exact-steps", default="", help="extra DDIM step counts for the exact part, e.g. 50,200")
    p.add_argument("--trained-steps", default="300,1000,3000", help="z_w training steps to score ('' = none)")
    p.add_argument("--train-images", type=int, default=4000)
    p.add_argument("--channels", default="16,32")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    pin_threads(a.threads)
    t0 = resolve_t0(0, a.epsilon, a.clip, 1e-5, "bound")
    k_shared, _ = split_steps(a.sample_steps, t0)
    train, test, public, info = load(a.dataset, a.image_size, a.seed, a.train_images)
    g = torch.Generator().manual_seed(a.seed + 11)
    idx = torch.randperm(len(test), generator=g)[:a.samples]
    y, real = test.y[idx].long(), privatize(test.x[idx], a.clip, t0, g)
    held_out = [privatize(public.x[torch.randperm(len(public), generator=g)[:a.samples]], a.clip, t0, g)
                for _ in range(REFERENCES)]
    setup = {**{k: v for k, v in vars(a).items() if k not in ("threads", "out")}, "t0": t0, "ddim_steps": k_shared}
    exact, trained = [], []
    step_counts = [k_shared] + [int(s) for s in a.exact_steps.split(",") if s]
    for mode in SHARED_MODES:
        zw = exact_denoiser(mode, train.x, a.clip, t0)
        for handover in HANDOVERS[1:]:  # auto is one of the others
            for k in (step_counts if handover != "ancestral" else [k_shared]):
                exact.append({"mode": mode, "handover": handover, "ddim_steps": k,
                              **score(zw, mode, handover, k, t0, a.clip, y, real, held_out, a.seed)})
    print(table(exact, f"Exact Gaussian z_w ({a.dataset} {a.image_size} px, t0 = {t0})"))
    for mode in SHARED_MODES:
        steps_done = 0
        torch.manual_seed(a.seed)
        zw = build_ddpm(a.image_size, info.num_classes, channels=a.channels)
        gx = torch.Generator().manual_seed(a.seed + 5)
        x_up = privatize(train.x, a.clip, t0, gx)
        t_range, source_t = shared_objective(mode, t0, zw.T)
        for target in [int(s) for s in a.trained_steps.split(",") if s]:
            t = time.time()  # continue training to the next checkpoint (a fresh seed per leg; Adam restarts)
            loss = train_ddpm(zw, x_up, train.y, steps=target - steps_done, batch=a.batch, lr=a.lr,
                              seed=a.seed + target, t_range=t_range, source_t=source_t)
            train_s, steps_done = time.time() - t, target
            zw.eval()
            for handover in HANDOVERS[1:]:
                trained.append({"mode": mode, "handover": handover, "zw_steps": target, "ddim_steps": k_shared,
                                "loss": loss, "train_seconds": round(train_s, 1),
                                **score(zw, mode, handover, k_shared, t0, a.clip, y, real, held_out, a.seed)})
            print(table(trained[-len(HANDOVERS) + 1:], f"trained z_w, {mode}, {target} steps"), flush=True)
            atomic_write_json(Path(a.out) / "pfdm_handover.json", {"setup": setup, "exact": exact, "trained": trained})
    if trained:
        print(table(trained, f"Trained z_w ({a.dataset} {a.image_size} px, t0 = {t0})"))
    atomic_write_json(Path(a.out) / "pfdm_handover.json", {"setup": setup, "exact": exact, "trained": trained})
