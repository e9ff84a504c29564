"""The diffusion prior's pipeline: one code path for the built-in tiny prior and Stable Diffusion 1.5.

A prior is an SD-1.5-layout folder (unet/, text_encoder/, tokenizer/, scheduler/, optional vae/)
loaded component by component with each class's from_pretrained (load_components). Without vae/ it
works in pixel space (encode/decode are the identity). As in diffusers' StableDiffusionPipeline, the
geometry is read from the components' configs, never stored beside them: vae_scale_factor from the
VAE's blocks, sample_size from the UNet, image_size = sample_size * vae_scale_factor. The noise
schedule is the pipeline's own betas wrapped in a DDIMScheduler config; the DDIM step and its
inversion are written here from the equations (samplers.py has the notation), so they do not depend
on diffusers' changing inverse-scheduler conventions.

Which spec names which folder (tiny, a folder, a hub id) is spec.py's business, not this module's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import torch
from torch.nn import functional as F

from fedapp.models import precision

from . import samplers
from .samplers import SamplerSettings

Condition: TypeAlias = torch.Tensor | list[str] | str


@dataclass
class SampleResult:
    images: torch.Tensor  # (B, 3, H, W) in [-1, 1]
    latents: torch.Tensor  # z_0, (B, *latent_shape)
    unet_evals: int  # per-sample noise predictions spent (a CFG pair counts 2), counted at the UNet call


class Prior:
    """Tokenizer + CLIP text encoder + UNet2DConditionModel + DDIM schedule (+ VAE when latent).

    All modules are frozen (eval, no grad to weights); gradients still flow to inputs, so a method
    can optimise a raw condition sequence (B, L, D) through predict_noise (Espresso).
    """

    def __init__(self, tokenizer, text_encoder, unet, scheduler, vae=None, device="cpu", dtype=torch.float32,
                 source: str = ""):
        from diffusers import DDIMScheduler

        self.device = torch.device(device)
        self.dtype = dtype
        self.source = source
        self.tokenizer = tokenizer
        self.text_encoder = _frozen(text_encoder, self.device, dtype)
        self.unet = _frozen(unet, self.device, dtype)
        self.vae = None if vae is None else _frozen(vae, self.device, dtype)
        # keep the pipeline's betas, sample with DDIM; our timesteps() is "leading" spacing. x0 is
        # clipped only when the pipeline's own config says so (SD-1.5: no; pixel-space tiny prior: yes),
        # not by DDIMScheduler's default, which would clip latents.
        raw = dict(scheduler.config)
        self.scheduler = DDIMScheduler.from_config(raw, timestep_spacing="leading",
                                                   clip_sample=bool(raw.get("clip_sample", False)))
        cfg = self.scheduler.config
        self.num_train_timesteps = int(cfg.num_train_timesteps)
        self.steps_offset = int(cfg.steps_offset)
        self.prediction_type = cfg.prediction_type
        self.clip_sample = float(cfg.clip_sample_range) if cfg.clip_sample else None
        self.alphas_cumprod = self.scheduler.alphas_cumprod.to(self.device)  # abar_t, float32
        self.final_alpha_cumprod = self.scheduler.final_alpha_cumprod.to(self.device)  # abar at t < 0
        self.scaling_factor = float(vae.config.scaling_factor) if vae is not None else 1.0
        self.unet_rows = 0  # rows passed through the UNet so far (the evaluation counter)
        self.vae_batch = 16  # images per VAE call (SD's VAE at 512 px is memory-hungry)
        self._null: torch.Tensor | None = None

    # ---- geometry, read from the components' configs -----------------------------------------
    @property
    def vae_scale_factor(self) -> int:
        """Image pixels per latent pixel: 2 ** (VAE down-blocks - 1) (SD-1.5: 8); 1 in pixel space."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1) if self.vae is not None else 1

    @property
    def sample_size(self) -> int:
        """Side of the UNet's input in latent pixels: unet.config.sample_size (SD-1.5: 64, tiny: 16)."""
        size = self.unet.config.sample_size
        if not isinstance(size, int):
            h, w = size
            if h != w:
                raise ValueError(f"unet.config.sample_size={tuple(size)}: only square priors are supported")
            size = h
        return int(size)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, h, w) of z_0 and of the noise z_T."""
        return int(self.unet.config.in_channels), self.sample_size, self.sample_size

    @property
    def image_size(self) -> int:
        """Side of the images the prior decodes to and encodes from."""
        return self.sample_size * self.vae_scale_factor

    @property
    def cond_shape(self) -> tuple[int, int]:
        """(L, D) of a condition: the text encoder's positions x the UNet's cross-attention width."""
        return int(self.text_encoder.config.max_position_embeddings), int(self.unet.config.cross_attention_dim)

    # ---- images <-> latents -------------------------------------------------------------------
    def prepare_images(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, H, W) in [-1, 1] -> on the prior's device and dtype, resized to image_size when it differs
        (bilinear with antialias, in float32), so a dataset's image size need not be kept equal to the prior's."""
        x = x.to(self.device)
        size = self.image_size
        if tuple(x.shape[-2:]) != (size, size):
            x = F.interpolate(x.float(), size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        return x.to(self.dtype)

    @torch.no_grad()
    def encode_images(self, x: torch.Tensor) -> torch.Tensor:
        """x in [-1, 1] (any size: prepare_images) -> z_0 = E(x): VAE posterior mean * scaling factor;
        identity in pixel space. Reads x vae_batch images at a time (bounded VAE memory; a split decoded
        lazily, feddata.LazyImages, is decoded a chunk at a time too)."""
        out = []
        for s in range(0, max(len(x), 1), self.vae_batch):
            c = self.prepare_images(x[s:s + self.vae_batch])
            out.append(c if self.vae is None else self.vae.encode(c).latent_dist.mean)
        return torch.cat(out) if self.vae is None else torch.cat(out) * self.scaling_factor

    @torch.no_grad()
    def decode_latents(self, z: torch.Tensor) -> torch.Tensor:
        """z_0 -> images in [-1, 1] (clamped)."""
        z = z.to(self.device, self.dtype)
        if self.vae is None:
            return z.clamp(-1, 1)
        return torch.cat([self.vae.decode(c / self.scaling_factor).sample
                          for c in z.split(self.vae_batch)]).clamp(-1, 1)

    # ---- conditions -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str] | str) -> torch.Tensor:
        """Prompts -> the text encoder's last hidden states (B, L, D), padded to L tokens (as SD)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.cond_shape[0], truncation=True,
                             return_tensors="pt").input_ids.to(self.device)
        return self.text_encoder(ids).last_hidden_state.to(self.dtype)

    def null_condition(self, batch: int) -> torch.Tensor:
        """The empty prompt's encoding, (batch, L, D): the unconditional branch of guidance. Encoded once,
        outside any autocast, so a bf16 sample asking first leaves no rounded copy to later float32 ones."""
        if self._null is None:
            with torch.autocast(self.device.type, enabled=False):
                self._null = self.encode_prompts([""])
        return self._null.expand(batch, -1, -1)

    def condition(self, cond: Condition, batch: int) -> torch.Tensor:
        """Prompts (str, list) or raw condition embeddings (B|1, L, D) -> a (batch, L, D) tensor."""
        if isinstance(cond, str):
            cond = [cond]
        if not torch.is_tensor(cond):
            cond = self.encode_prompts(list(cond))
        cond = cond.to(self.device, self.dtype)  # type: ignore[union-attr]  # a tensor now (torch.is_tensor)
        if cond.ndim != 3 or cond.shape[1:] != self.cond_shape or cond.shape[0] not in (1, batch):
            raise ValueError(f"condition of shape {tuple(cond.shape)}: expected ({batch} or 1, "
                             f"{self.cond_shape[0]}, {self.cond_shape[1]})")
        return cond.expand(batch, -1, -1)

    # ---- noise prediction ---------------------------------------------------------------------
    def _timestep(self, t, batch: int) -> torch.Tensor:
        t = torch.as_tensor(t, device=self.device)
        return t.expand(batch) if t.ndim == 0 else t

    def _abar(self, t, x: torch.Tensor) -> torch.Tensor:
        """abar_t broadcast against x; t < 0 means the clean end (final_alpha_cumprod)."""
        t = torch.as_tensor(t, device=self.device)
        a = torch.where(t >= 0, self.alphas_cumprod[t.clamp(min=0)], self.final_alpha_cumprod)
        return a.to(x.dtype).reshape(-1, *([1] * (x.ndim - 1))) if a.ndim else a.to(x.dtype)

    def _eps(self, z: torch.Tensor, t, cond: torch.Tensor) -> torch.Tensor:
        """One UNet call; counts its rows and converts v/x0 predictions to epsilon."""
        t = self._timestep(t, z.shape[0])
        out = self.unet(z, t, encoder_hidden_states=cond).sample.to(z.dtype)  # a no-op unless under autocast
        self.unet_rows += z.shape[0]
        if self.prediction_type == "epsilon":
            return out
        a = self._abar(t, z)
        if self.prediction_type == "v_prediction":  # eps = sqrt(abar) v + sqrt(1-abar) z
            return a.sqrt() * out + (1 - a).sqrt() * z
        return (z - a.sqrt() * out) / (1 - a).sqrt()  # "sample": out is x0

    def predict_noise(self, z: torch.Tensor, t, cond: Condition, guidance: float = 1.0,
                      uncond: Condition | None = None) -> torch.Tensor:
        """eps~ = eps(z,t,∅) + gamma (eps(z,t,c) - eps(z,t,∅)); gamma = 1: one conditional pass only,
        gamma = 0: one unconditional pass; otherwise both branches in one batched UNet call."""
        batch = z.shape[0]
        cond = self.condition(cond, batch)
        if guidance == 1.0:
            return self._eps(z, t, cond)
        uncond = self.null_condition(batch) if uncond is None else self.condition(uncond, batch)
        if guidance == 0.0:
            return self._eps(z, t, uncond)
        t = self._timestep(t, batch)
        eps_u, eps_c = self._eps(torch.cat([z, z]), torch.cat([t, t]), torch.cat([uncond, cond])).chunk(2)
        return eps_u + guidance * (eps_c - eps_u)

    # ---- decoder features (DIFT) -----------------------------------------------------------------
    @property
    def num_up_blocks(self) -> int:
        return len(self.unet.up_blocks)

    def up_block_channels(self, i: int) -> int:
        """Channels of decoder up-block i's output."""
        return int(self.unet.up_blocks[i].resnets[-1].conv2.out_channels)

    @torch.no_grad()
    def decoder_features(self, z_t: torch.Tensor, t, cond: torch.Tensor, blocks: tuple[int, ...]) -> list[torch.Tensor]:
        """One conditional UNet pass on z_t; the outputs of decoder up-blocks `blocks` (B, C_i, h_i, w_i),
        read with forward hooks: the one place that knows the UNet's internals (DIFT, FedDifRC)."""
        captured: dict[int, torch.Tensor] = {}
        hooks = [self.unet.up_blocks[i].register_forward_hook(
            lambda _m, _inp, out, k=k: captured.__setitem__(k, out[0] if isinstance(out, tuple) else out))
            for k, i in enumerate(blocks)]
        try:
            self._eps(z_t, t, cond)
        finally:
            for h in hooks:
                h.remove()
        return [captured[k] for k in range(len(blocks))]

    # ---- the DDIM equations ----------------------------------------------------------------------
    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t) -> torch.Tensor:
        """Forward diffusion q(z_t | z_0): z_t = sqrt(abar_t) z_0 + sqrt(1 - abar_t) eps."""
        a = self._abar(t, x0)
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    def loss(self, z0: torch.Tensor, cond: Condition, t: torch.Tensor | None = None, noise: torch.Tensor | None = None,
             generator: torch.Generator | None = None, reduction: str = "mean") -> torch.Tensor:
        """The prior's own training objective, E_{t,eps} ||target - net(z_t, t, c)||^2 with the target of its
        prediction type (eps, v or x0); gradients reach a raw condition `cond` (Espresso's Eq. 8). For an
        eps-prior this is exactly E||eps - eps_theta(sqrt(abar_t) z0 + sqrt(1-abar_t) eps, t, c)||^2.
        reduction="none": one mean squared error per row (B,), whose mean is the "mean" loss."""
        if reduction not in ("mean", "none"):
            raise ValueError(f"reduction={reduction!r}: allowed 'mean', 'none'")
        batch = z0.shape[0]
        if t is None:
            t = torch.randint(0, self.num_train_timesteps, (batch,), generator=generator)
        if noise is None:
            noise = torch.randn(z0.shape, generator=generator)
        t, noise = self._timestep(t, batch), noise.to(self.device, self.dtype)
        out = self.unet(self.add_noise(z0, noise, t), t, encoder_hidden_states=self.condition(cond, batch)).sample
        self.unet_rows += batch
        target = diffusion_target(self.prediction_type, z0, noise, self._abar(t, z0))
        if reduction == "none":
            return (out - target).pow(2).flatten(1).mean(1)
        return torch.nn.functional.mse_loss(out, target)

    def timesteps(self, num_steps: int, spacing: str = "leading") -> torch.Tensor:
        """DDIM timesteps, descending ("leading" spacing + the pipeline's steps_offset, or "trailing")."""
        return samplers.schedule(num_steps, self.num_train_timesteps, self.steps_offset, spacing)

    def ddim_step(self, z_t: torch.Tensor, eps: torch.Tensor, t, t_prev) -> torch.Tensor:
        """Deterministic DDIM (eta = 0), z_t -> z_{t_prev}:
        x0 = (z_t - sqrt(1-abar_t) eps) / sqrt(abar_t)   [clamped when the scheduler config clips]
        z_{t_prev} = sqrt(abar_{t_prev}) x0 + sqrt(1 - abar_{t_prev}) eps
        (same operation order as DDIMScheduler.step, so the two agree to float rounding)."""
        a_t, a_prev = self._abar(t, z_t), self._abar(t_prev, z_t)
        x0 = (z_t - (1 - a_t) ** 0.5 * eps) / a_t ** 0.5
        if self.clip_sample is not None:
            x0 = x0.clamp(-self.clip_sample, self.clip_sample)
        return a_prev ** 0.5 * x0 + (1 - a_prev) ** 0.5 * eps

    def ddim_invert_step(self, z_prev: torch.Tensor, eps: torch.Tensor, t_prev, t) -> torch.Tensor:
        """DDIM inversion, z_{t_prev} -> z_t (t > t_prev). Convention: eps = eps(z_{t_prev}, t_prev),
        i.e. the noise predicted at the *lower* timestep stands in for eps(z_t, t) (the local-linearity
        assumption of DDIM inversion); at the clean end (t_prev < 0) callers evaluate the UNet at 0.
        x0 = (z_{t_prev} - sqrt(1-abar_{t_prev}) eps) / sqrt(abar_{t_prev});  z_t = sqrt(abar_t) x0 + sqrt(1-abar_t) eps
        No clipping: inversion must stay invertible."""
        a_prev, a_t = self._abar(t_prev, z_prev), self._abar(t, z_prev)
        x0 = (z_prev - (1 - a_prev) ** 0.5 * eps) / a_prev ** 0.5
        return a_t ** 0.5 * x0 + (1 - a_t) ** 0.5 * eps

    # ---- sampling ------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, noise: torch.Tensor | int, cond: Condition, settings: SamplerSettings = SamplerSettings(), *,
               uncond: Condition | None = None, generator: torch.Generator | None = None) -> SampleResult:
        """z_T = noise (a tensor (B, *latent_shape), or a batch size drawn with `generator`) -> images.
        cond: prompts or raw condition embeddings (B|1, L, D); `settings`: the sampler, its steps, spacing and
        guidance (samplers.SamplerSettings; its guidance is gamma1 for "zigzag"; its precision: the UNet calls'
        autocast, fedapp.models.precision); uncond: the guidance's negative condition (default: the empty prompt).
        The loop's own arithmetic and the decoder stay in the prior's dtype."""
        s = settings
        if isinstance(noise, int):
            noise = torch.randn(noise, *self.latent_shape, generator=generator)
        z = noise.to(self.device, self.dtype)
        batch = z.shape[0]
        cond = self.condition(cond, batch)
        uncond = None if uncond is None else self.condition(uncond, batch)
        rows0 = self.unet_rows
        if s.sampler not in ("ddim", "zigzag"):
            raise ValueError(f"sampler={s.sampler!r}: allowed 'ddim', 'zigzag'")
        with precision.autocast(s.precision, self.device):
            if s.sampler == "ddim":
                z0 = samplers.ddim_loop(self, z, cond, uncond, s.num_steps, s.guidance, s.spacing)
            else:
                z0 = samplers.zigzag_loop(self, z, cond, uncond, s.num_steps, s.guidance, s.gamma2, s.zigzag_t,
                                          s.spacing, s.zigzag)
        return SampleResult(self.decode_latents(z0), z0, (self.unet_rows - rows0) // batch)

    # ---- saving --------------------------------------------------------------------------------
    def save_pretrained(self, folder: str | Path) -> Path:
        """Write the SD-1.5 layout (unet/, text_encoder/, tokenizer/, scheduler/, vae/ if latent)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_components(folder, self.tokenizer, self.text_encoder, self.unet, self.scheduler, self.vae)
        return folder


def diffusion_target(prediction_type: str, z0: torch.Tensor, noise: torch.Tensor, abar_t: torch.Tensor) -> torch.Tensor:
    """Regression target of a diffusion net: eps; v = sqrt(abar) eps - sqrt(1-abar) z0 (Salimans & Ho 2022); z0."""
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return abar_t.sqrt() * noise - (1 - abar_t).sqrt() * z0
    if prediction_type == "sample":
        return z0
    raise ValueError(f"prediction_type={prediction_type!r}: allowed 'epsilon', 'v_prediction', 'sample'")


def save_components(folder: Path, tokenizer, text_encoder, unet, scheduler, vae=None) -> None:
    """save_pretrained of each component into its subfolder, plus a diffusers-style model_index.json."""
    import diffusers

    unet.save_pretrained(folder / "unet")
    text_encoder.save_pretrained(folder / "text_encoder")
    tokenizer.save_pretrained(folder / "tokenizer")
    scheduler.save_pretrained(folder / "scheduler")
    index = {"_class_name": "StableDiffusionPipeline" if vae is not None else "FedappPixelPrior",
             "_diffusers_version": diffusers.__version__,
             "unet": ["diffusers", type(unet).__name__],
             "text_encoder": ["transformers", type(text_encoder).__name__],
             "tokenizer": ["transformers", type(tokenizer).__name__],
             "scheduler": ["diffusers", type(scheduler).__name__]}
    if vae is not None:
        vae.save_pretrained(folder / "vae")
        index["vae"] = ["diffusers", type(vae).__name__]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))


def _frozen(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """On `device`, in eval mode, no gradients to its weights; cast only when loaded in another dtype
    (diffusers warns about casting a loaded model with to(dtype): load it in the dtype instead)."""
    same = all(p.dtype == dtype for p in module.parameters())
    return (module.to(device) if same else module.to(device, dtype)).eval().requires_grad_(False)


def load_components(source: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> Prior:
    """A Prior from an SD-1.5-layout folder or hub id, each component through its class's from_pretrained.
    A local folder has a VAE when it has vae/; a hub SD pipeline always has one."""
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import AutoTokenizer, CLIPTextModel

    from transformers.utils import logging as hf_logging

    src = str(source)
    # low_cpu_mem_usage=False: the default asks for `accelerate` (and prints why) to save a copy of
    # weights this small; transformers' per-load progress bar is noise in a federation's log
    unet = UNet2DConditionModel.from_pretrained(src, subfolder="unet", dtype=dtype, low_cpu_mem_usage=False)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        text_encoder = CLIPTextModel.from_pretrained(src, subfolder="text_encoder", dtype=dtype)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(src, subfolder="tokenizer")
    raw = DDIMScheduler.load_config(src, subfolder="scheduler")  # the file as written (PNDM for SD-1.5)
    scheduler = DDIMScheduler.from_config(raw, clip_sample=bool(raw.get("clip_sample", False)))
    # from_pretrained itself takes an existing folder before a hub id: the same test here
    has_vae = (Path(src) / "vae").is_dir() if Path(src).is_dir() else True
    vae = AutoencoderKL.from_pretrained(src, subfolder="vae", dtype=dtype, low_cpu_mem_usage=False) if has_vae else None
    return Prior(tokenizer, text_encoder, unet, scheduler, vae, device=device, dtype=dtype, source=src)
