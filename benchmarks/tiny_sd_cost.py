"""Per-image synthesis cost of tiny-sd (32 px images from 8x8x4 latents) against the pixel tiny prior (16 px).

    python benchmarks/tiny_sd_cost.py [--batch 64] [--steps 25] [--guidance 3] [--repeats 3] [--threads 1]

Both priors are built with random weights from the configurations a build uses (TinyPriorConfig at 16 px;
LATENT_CONFIG on 8x8x4 latents with a TinyVaeConfig AutoencoderKL at 32 px; the cost of a call does not
depend on the weights). Per repeat, each prior samples one guided DDIM batch from the same sampler code
(Prior.sample), interleaved so that the machine's changing load hits both alike; the table gives the median
seconds per image, the ratio to the 16 px pixel prior measured in the same run, and the VAE decode's share of
tiny-sd's time. Also printed: the 28 px pixel prior (what real digits cost without a VAE).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from experiments.cli import common_args, pin_threads


def pixel_prior(image_size: int):
    from fedapp.models.prior.tiny import random_tiny_prior

    return random_tiny_prior(image_size=image_size)


def latent_prior():
    from fedapp.models.prior.pipeline import Prior
    from fedapp.models.prior.tiny.config import LATENT_CONFIG, LATENT_IMAGE_SIZE, TinyVaeConfig
    from fedapp.models.prior.tiny.modules import build_modules
    from fedapp.models.prior.tiny.vae import build_vae
    from fedapp.models.text import class_prompts, prompt_words

    torch.manual_seed(0)
    words = prompt_words(class_prompts("digits", ["zero", "one", "two", "three", "four", "five", "six", "seven",
                                                  "eight", "nine"]))
    vae_config = TinyVaeConfig()
    latent_side = LATENT_IMAGE_SIZE // 2 ** (len(vae_config.block_out_channels) - 1)
    tokenizer, text, unet, scheduler = build_modules(LATENT_CONFIG, words, latent_side, vae_config.latent_channels)
    scheduler.register_to_config(clip_sample=False, steps_offset=1)
    return Prior(tokenizer, text, unet, scheduler, vae=build_vae(vae_config, LATENT_IMAGE_SIZE), source="random")


def time_sample(prior, batch: int, steps: int, guidance: float) -> tuple[float, float]:
    """(seconds of one guided batch, of which the VAE decode)."""
    from fedapp.models.prior.samplers import SamplerSettings

    noise = torch.randn(batch, *prior.latent_shape, generator=torch.Generator().manual_seed(0))
    prompts = ["a photo of the digit three"] * batch
    decode, real = [0.0], prior.decode_latents

    def timed_decode(z):
        t = time.perf_counter()
        out = real(z)
        decode[0] += time.perf_counter() - t
        return out

    prior.decode_latents = timed_decode
    t = time.perf_counter()
    prior.sample(noise, prompts, SamplerSettings(num_steps=steps, guidance=guidance))
    total = time.perf_counter() - t
    prior.decode_latents = real
    return total, decode[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[common_args(threads=1)])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--guidance", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    pin_threads(a.threads)
    priors = {"pixel tiny, 16 px": pixel_prior(16), "tiny-sd, 32 px (8x8x4 latents)": latent_prior(),
              "pixel tiny, 28 px": pixel_prior(28)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in priors}
    for name, prior in priors.items():  # warm-up: first calls allocate
        time_sample(prior, 4, 2, a.guidance)
    for _ in range(a.repeats):
        for name, prior in priors.items():
            times[name].append(time_sample(prior, a.batch, a.steps, a.guidance))
    base = statistics.median(t for t, _ in times["pixel tiny, 16 px"]) / a.batch
    print(f"{a.batch} images a batch, {a.steps} DDIM steps at guidance {a.guidance}, {a.threads} thread(s), "
          f"median of {a.repeats}")
    print(f"{'prior':<34}{'ms / image':>11}{'vs 16 px pixel':>16}{'VAE decode share':>18}{'UNet params':>13}")
    for name, prior in priors.items():
        per = statistics.median(t for t, _ in times[name]) / a.batch
        share = statistics.median(d / t for t, d in times[name]) if prior.vae is not None else 0.0
        params = sum(q.numel() for q in prior.unet.parameters())
        print(f"{name:<34}{1000 * per:>11.2f}{per / base:>15.2f}x{100 * share:>17.1f}%{params:>13,}")


if __name__ == "__main__":
    main()
