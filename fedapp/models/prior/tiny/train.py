"""Training the tiny prior on a dataset's public split, and the cached build around it.

Text encoder and UNet are trained jointly on class prompts ("a photo of the digit three") with 10%
empty prompts (for classifier-free guidance), then saved with save_pretrained into the cache folder,
so the trained prior loads through the same from_pretrained code as Stable Diffusion.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch.nn import functional as F

from ...text import class_prompts, prompt_words
from ..pipeline import diffusion_target, save_components
from .cache import hash_data, publish, tiny_prior_path, write_json
from .config import CODE_VERSION, DEFAULT_IMAGE_SIZE, DEFAULT_STEPS, LATENT_CONFIG, TinyPriorConfig, TinyVaeConfig
from .modules import build_modules
from .vae import encode_means, train_vae


def public_data(dataset: str, image_size: int = DEFAULT_IMAGE_SIZE, seed: int = 0,
                domains: tuple[str, ...] | None = None):
    """(x, y, class_names) of the dataset's public split (feddata; independent of the partitioner);
    with `domains`, only its images of those domains (a prior that has never seen the others)."""
    server = server_split(dataset, image_size, seed)
    pub = server.public
    if domains is not None:
        keep = torch.isin(pub.attrs["domain"], torch.tensor(domain_ids(dataset, domains, server.info.attributes)))
        pub = pub.subset(torch.nonzero(keep).flatten())
    return pub.x, pub.y, list(server.info.class_names)


def server_split(dataset: str, image_size: int = DEFAULT_IMAGE_SIZE, seed: int = 0):
    """feddata's server data of the dataset: its public split (the prior's training data) and test split.
    The partitioner is iid over 4 clients: the public split does not depend on either."""
    import feddata

    return feddata.load_server_data(dataset, "iid", {}, seed, num_partitions=4, image_size=image_size)


def domain_ids(dataset: str, domains: tuple[str, ...], attributes: dict[str, list[str]]) -> list[int]:
    """Indices of `domains` in the dataset's domain attribute; a ValueError names what is allowed."""
    allowed = attributes.get("domain")
    if not allowed:
        raise ValueError(f"domains {'+'.join(domains)!r}: dataset {dataset!r} has no domains")
    if not domains or any(d not in allowed for d in domains):
        raise ValueError(f"domains {'+'.join(domains)!r}: allowed one or more of {', '.join(allowed)} "
                         f"(the domains of {dataset!r}), joined by '+'")
    return [allowed.index(d) for d in domains]


def lr_factor(step: int, steps: int, warmup: float, schedule: str = "constant") -> float:
    """Multiplier of the base learning rate: linear warm-up, then constant or cosine to 0."""
    w = max(1, int(warmup * steps))
    if step < w:
        return (step + 1) / w
    if schedule == "constant":
        return 1.0
    return 0.5 * (1 + math.cos(math.pi * (step - w) / max(1, steps - w)))


def train_tiny_prior(x: torch.Tensor, y: torch.Tensor, prompts: list[str], config: TinyPriorConfig,
                     steps: int, seed: int = 0, progress: bool = True):
    """Jointly train text encoder tau + UNet on (x, prompts[y]) with E_{t,eps} ||target - net(z_t, t, tau(prompt))||^2,
    z_t = sqrt(abar_t) x + sqrt(1-abar_t) eps, target = v = sqrt(abar_t) eps - sqrt(1-abar_t) x (or eps);
    returns the EMA modules. v-prediction weights high-noise steps by 1/abar_t against eps-prediction:
    that is where the class decides the digit's shape."""
    import copy

    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    words = prompt_words(prompts + list(config.extra_words))
    tokenizer, text_encoder, unet, scheduler = build_modules(config, words, image_size=x.shape[-1],
                                                             channels=x.shape[1])
    ids = tokenizer(prompts + [""], padding="max_length", max_length=config.max_tokens, truncation=True,
                    return_tensors="pt").input_ids  # (K+1, L); the last row is the empty prompt
    abar = scheduler.alphas_cumprod
    T = scheduler.config.num_train_timesteps
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW([{"params": list(unet.parameters()), "lr": config.lr},
                             {"params": list(text_encoder.parameters()), "lr": config.lr * config.text_lr_mult}],
                            weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, config.warmup, config.lr_schedule))
    ema_unet, ema_text = copy.deepcopy(unet).requires_grad_(False), copy.deepcopy(text_encoder).requires_grad_(False)
    unet.train(), text_encoder.train()
    n, perm, pos = len(x), torch.randperm(len(x), generator=g), 0
    losses, t0, cpu0 = [], time.time(), time.process_time()
    bar = tqdm(range(steps), desc="tiny prior", disable=not progress, mininterval=2)
    for step in bar:
        if pos + config.batch_size > n:
            perm, pos = torch.randperm(n, generator=g), 0
        idx = perm[pos:pos + config.batch_size]
        pos += config.batch_size
        x0 = x[idx]
        label = y[idx].clone()
        label[torch.rand(len(idx), generator=g) < config.p_uncond] = len(prompts)  # empty prompt
        if config.t_sampling == "logit_normal":
            t = (torch.sigmoid(torch.randn(len(idx), generator=g)) * T).long().clamp(0, T - 1)
        else:
            t = torch.randint(0, T, (len(idx),), generator=g)
        eps = torch.randn(x0.shape, generator=g)
        a = abar[t].view(-1, 1, 1, 1)
        z_t = a.sqrt() * x0 + (1 - a).sqrt() * eps
        cond = text_encoder(ids[label]).last_hidden_state
        target = diffusion_target(config.prediction_type, x0, eps, a)
        loss = F.mse_loss(unet(z_t, t, encoder_hidden_states=cond).sample, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        # EMA with warm-up (decay grows as (1+s)/(10+s)) so that a few hundred steps suffice
        d = min(config.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for ema, live in ((ema_unet, unet), (ema_text, text_encoder)):
                for pe, pl in zip(ema.parameters(), live.parameters()):
                    pe.lerp_(pl, 1 - d)
        losses.append(loss.item())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}")
    # cpu_seconds: this process's CPU time; with 1 thread it is the wall time the build takes on an idle
    # core, whatever else shares the machine (wall `seconds` grows with the machine's load)
    facts = {"steps": steps, "seconds": round(time.time() - t0, 1), "cpu_seconds": round(time.process_time() - cpu0, 1),
             "threads": torch.get_num_threads(), "load_average": round(os.getloadavg()[0], 1),
             "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 5), "num_images": n,
             "batch_size": config.batch_size, "lr": config.lr, "ema_decay": config.ema_decay,
             "unet_params": sum(p.numel() for p in unet.parameters()),
             "text_encoder_params": sum(p.numel() for p in text_encoder.parameters())}
    return tokenizer, ema_text.eval(), ema_unet.eval(), scheduler, facts


def build_tiny_prior(dataset: str, image_size: int = DEFAULT_IMAGE_SIZE, steps: int = DEFAULT_STEPS, seed: int = 0,
                     cache_dir: str | Path | None = None, progress: bool = True, *,
                     config: TinyPriorConfig | None = None, data=None, domains: tuple[str, ...] | None = None,
                     vae: TinyVaeConfig | None = None, vae_domains: str = "all") -> Path:
    """Train (or find cached) the tiny prior of `dataset`; returns its folder.

    data: optional (x, y, class_names) replacing feddata's public split (tests); it then enters the
    cache key through a hash of its contents. domains: train on the public images of these domains
    only (their own cache key). vae: tiny-sd, a latent prior: an AutoencoderKL is trained first (vae.py)
    and the UNet (config default LATENT_CONFIG) on its scaled posterior means; saved with vae/ as SD is.
    vae_domains (with domains and vae): `all` trains the VAE on every domain's public images, `same` on
    `domains` only (cache.check_vae_domains says why `all` is the default). The folder appears whole or not
    at all (cache.publish).
    """
    config = config or (LATENT_CONFIG if vae is not None else TinyPriorConfig())
    folder = tiny_prior_path(dataset, image_size, steps, seed, cache_dir, config,
                             hash_data(*data) if data is not None else "", domains, vae, vae_domains)
    if (folder / "prior_meta.json").is_file():
        return folder
    x, y, class_names = data if data is not None else public_data(dataset, image_size, seed, domains)
    x, y = x.float(), y.long()
    if x.shape[-1] != image_size:
        raise ValueError(f"image_size={image_size}: data has {tuple(x.shape[-2:])} images")
    prompts = class_prompts(dataset, class_names)
    autoencoder, vae_facts = None, {}
    if vae is not None:
        all_domains = data is None and domains is not None and vae_domains == "all"
        x_vae = public_data(dataset, image_size, seed)[0].float() if all_domains else x
        autoencoder, vae_facts = train_vae(x_vae, vae, seed, progress)
        vae_facts["vae_num_images"] = len(x_vae)
    z = x if autoencoder is None else encode_means(autoencoder, x) * autoencoder.config.scaling_factor
    tokenizer, text_encoder, unet, scheduler, facts = train_tiny_prior(z, y, prompts, config, steps, seed, progress)
    if autoencoder is not None:
        # latents are not bounded to [-1, 1] (SD: no clipping); steps_offset 1 as SD-1.5 (and as
        # StableDiffusionPipeline rewrites a 0 to), so that both samplers step through the same timesteps
        scheduler.register_to_config(clip_sample=False, steps_offset=1)
    meta = {"dataset": dataset, "domains": sorted(domains) if domains is not None else "all",
            **({"vae_domains": vae_domains if domains is not None else "all"} if vae is not None else {}),
            "image_size": image_size, "seed": seed, "class_names": class_names,
            "prompts": prompts, "config": asdict(config), "code_version": CODE_VERSION, **facts,
            **({"latent": True, "vae_config": asdict(vae), **vae_facts} if vae is not None else {})}

    def write(tmp: Path) -> None:
        save_components(tmp, tokenizer, text_encoder, unet, scheduler, autoencoder)
        write_json(tmp / "prior_meta.json", meta)

    return publish(folder, write)
