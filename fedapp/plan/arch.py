"""The prior's architecture from its config files alone: no weights, no network.

`prior_arch(spec, dataset)` reads the unet/, text_encoder/, vae/ and scheduler/ configs of what the
`prior` key names (fedapp.models.prior.resolve_prior says which kind it is):
  - a built tiny prior or a local folder: its config files (a folder of configs without weights plans too);
  - a tiny prior not built yet: the configs its build would write (TinyPriorConfig, tiny-sd's VAE);
  - a hub id: the local Hugging Face cache when it holds the configs, else the configs shipped in
    fedapp/plan/hub_configs.py (SD-1.5, SD-2.1; SD-1.5 for an id it does not know): the planner never
    asks the hub, and `source` says which was used.
`meta_module` instantiates a component on the meta device (no memory), for parameter counts and shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedapp.options import ConfigError

COMPONENTS = {"unet": "config.json", "text_encoder": "config.json", "vae": "config.json",
              "scheduler": "scheduler_config.json"}


@dataclass(frozen=True)
class PriorArch:
    unet: dict[str, Any]  # UNet2DConditionModel config
    text: dict[str, Any]  # CLIPTextModel config
    vae: dict[str, Any] | None  # AutoencoderKL config; None in pixel space
    scheduler: dict[str, Any]
    source: str  # where the configs were read (for the report)

    @property
    def sample_size(self) -> int:
        size = self.unet["sample_size"]
        return int(size if isinstance(size, int) else size[0])

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae["block_out_channels"]) - 1) if self.vae else 1

    @property
    def image_size(self) -> int:
        return self.sample_size * self.vae_scale_factor

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return int(self.unet["in_channels"]), self.sample_size, self.sample_size

    @property
    def latent_dim(self) -> int:
        c, h, w = self.latent_shape
        return c * h * w

    @property
    def cond_shape(self) -> tuple[int, int]:
        """(L, D): the text encoder's positions x the UNet's cross-attention width (Prior.cond_shape)."""
        return int(self.text["max_position_embeddings"]), int(self.unet["cross_attention_dim"])

    @property
    def num_up_blocks(self) -> int:
        return len(self.unet["up_block_types"])

    @property
    def num_train_timesteps(self) -> int:
        return int(self.scheduler.get("num_train_timesteps", 1000))

    @property
    def steps_offset(self) -> int:
        return int(self.scheduler.get("steps_offset", 0))


def _read(folder: Path, component: str) -> dict[str, Any] | None:
    path = folder / component / COMPONENTS[component]
    return json.loads(path.read_text()) if path.is_file() else None


def folder_arch(folder: Path, source: str) -> PriorArch:
    got = {c: _read(folder, c) for c in COMPONENTS}
    missing = [c for c in ("unet", "text_encoder", "scheduler") if got[c] is None]
    if missing:
        raise ConfigError(f"prior={str(folder)!r}: no {', '.join(f'{c}/{COMPONENTS[c]}' for c in missing)}")
    return PriorArch(got["unet"], got["text_encoder"], got["vae"], got["scheduler"], source)


def hub_cached_folder(repo_id: str) -> Path | None:
    """The snapshot folder of `repo_id` in the local Hugging Face cache when it holds unet/config.json."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "unet/config.json")
    except Exception:  # a malformed id: not cached
        return None
    return Path(found).parents[1] if isinstance(found, str) else None


def shipped_arch(repo_id: str) -> PriorArch:
    """The shipped configs of a known hub id (hub_configs.KNOWN), Stable Diffusion 1.5's for any other."""
    from fedapp.plan import hub_configs

    known = hub_configs.KNOWN.get(repo_id)
    pipe = known or hub_configs.SD15
    why = "its shipped configs" if known else "an unknown id: Stable Diffusion 1.5's configs assumed"
    return PriorArch(dict(pipe["unet"]), dict(pipe["text"]), dict(pipe["vae"]), dict(pipe["scheduler"]),
                     f"{repo_id} ({pipe['name']}; not in the local Hugging Face cache, {why}: "
                     "fedapp/plan/hub_configs.py)")


def unbuilt_tiny_arch(src) -> PriorArch:
    """The configs a tiny(-sd) build of `src` would write (its modules built untrained, a few ms)."""
    from fedapp.models.prior.spec import tiny_image_size
    from fedapp.models.prior.tiny.config import LATENT_CONFIG, TinyPriorConfig, TinyVaeConfig
    from fedapp.models.prior.tiny.modules import build_modules

    config = LATENT_CONFIG if src.latent else TinyPriorConfig()
    size = tiny_image_size(src.dataset, src.latent)
    vae = None
    if src.latent:
        from fedapp.models.prior.tiny.vae import build_vae

        vae = dict(build_vae(TinyVaeConfig(), size).config)
        size //= 2 ** (len(vae["block_out_channels"]) - 1)
        channels = vae["latent_channels"]
    _, text, unet, sched = build_modules(config, ["a"], size, **({"channels": channels} if src.latent else {}))
    return PriorArch(dict(unet.config), text.config.to_dict(), vae, dict(sched.config),
                     f"tiny prior of {src.dataset} (not built yet: the configs its build writes)")


def prior_arch(spec: str, dataset: str | None) -> PriorArch:
    """The architecture `spec` names (module docstring); a ConfigError names the key when it names nothing."""
    from fedapp.models.prior import resolve_prior

    try:
        src = resolve_prior(spec, dataset)
    except ValueError as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    if src.kind == "hub":
        folder = hub_cached_folder(src.location)
        if folder is None:
            return shipped_arch(src.location)
        return folder_arch(folder, f"{src.location} (local Hugging Face cache)")
    if src.folder.is_dir():
        return folder_arch(src.folder, f"{src.kind} prior at {src.folder}")
    return unbuilt_tiny_arch(src)


def meta_module(kind: str, config: dict[str, Any], device: str = "meta"):
    """A prior component (`unet`, `vae`, `text`) built from its config on `device` (meta: no memory
    allocated, parameters have shapes only)."""
    import torch

    with torch.device(device):
        if kind == "text":
            from transformers import CLIPTextConfig, CLIPTextModel

            return CLIPTextModel(CLIPTextConfig(**{k: v for k, v in config.items() if not k.startswith("_")}))
        from diffusers import AutoencoderKL, UNet2DConditionModel

        return (UNet2DConditionModel if kind == "unet" else AutoencoderKL).from_config(config)


def parameter_counts(arch: PriorArch) -> dict[str, int]:
    """Parameters of each component, counted on the meta device."""
    comps = {"unet": arch.unet, "text": arch.text, **({"vae": arch.vae} if arch.vae else {})}
    return {k: sum(p.numel() for p in meta_module(k, c).parameters()) for k, c in comps.items()}
