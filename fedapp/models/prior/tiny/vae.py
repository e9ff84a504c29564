"""tiny-sd's VAE: a diffusers AutoencoderKL trained here, so that a tiny prior works in latent space as
Stable Diffusion does (images -> 4-channel latents -> UNet -> VAE decoder)."""

from __future__ import annotations

import os
import time

import torch
from torch.nn import functional as F

from .config import TinyVaeConfig


def build_vae(config: TinyVaeConfig, image_size: int, channels: int = 3):
    """An untrained AutoencoderKL from `config` (its sample_size = image_size)."""
    from diffusers import AutoencoderKL

    n = len(config.block_out_channels)
    return AutoencoderKL(in_channels=channels, out_channels=channels, down_block_types=("DownEncoderBlock2D",) * n,
                         up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(config.block_out_channels),
                         latent_channels=config.latent_channels, layers_per_block=config.layers_per_block,
                         norm_num_groups=config.norm_num_groups, sample_size=image_size)


def train_vae(x: torch.Tensor, config: TinyVaeConfig, seed: int = 0, progress: bool = True):
    """Adam on MSE(D(z), x) + kl_weight * KL(q(z|x) || N(0, I)), z drawn from the posterior (seeded); then the
    latent scaling factor is set as SD's is, 1 / std of the posterior means on `x`, so that the UNet sees
    unit-variance latents. Returns (vae in eval mode, facts)."""
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    vae = build_vae(config, x.shape[-1], x.shape[1])
    opt = torch.optim.Adam(vae.parameters(), lr=config.lr)
    vae.train()
    losses, t0, cpu0 = [], time.time(), time.process_time()
    for step in tqdm(range(config.steps), desc="tiny-sd vae", disable=not progress, mininterval=2):
        xb = x[torch.randint(0, len(x), (min(config.batch_size, len(x)),), generator=g)]
        post = vae.encode(xb).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=g)
        rec = F.mse_loss(vae.decode(z).sample, xb)
        loss = rec + config.kl_weight * post.kl().mean() / post.mean[0].numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(rec.item())
    vae.eval().requires_grad_(False)
    scale = 1.0 / float(encode_means(vae, x).std())
    vae.register_to_config(scaling_factor=scale)
    tail = losses[-max(1, len(losses) // 10):]
    return vae, {"vae_steps": config.steps, "vae_seconds": round(time.time() - t0, 1),
                 "vae_cpu_seconds": round(time.process_time() - cpu0, 1),
                 "vae_final_mse": round(sum(tail) / len(tail), 5),
                 "vae_params": sum(p.numel() for p in vae.parameters()), "scaling_factor": round(scale, 5),
                 "vae_load_average": round(os.getloadavg()[0], 1)}


@torch.no_grad()
def encode_means(vae, x: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """Posterior means E(x), unscaled (what Prior.encode_images multiplies by the scaling factor)."""
    return torch.cat([vae.encode(c).latent_dist.mean for c in x.split(batch)])
