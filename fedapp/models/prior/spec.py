"""Prior specs: the one place that knows what the `prior` config key may name.

Three kinds:
  - `tiny` / `tiny:<dataset>`: the built-in tiny prior of that dataset (default: the run's dataset,
    else digit-styles), found in its content-addressed cache folder and built there on request;
    `tiny@<domain>[+<domain>...]` / `tiny:<dataset>@...`: the same prior trained on those domains of
    the public split only (`tiny@photo`: a prior that has never seen sketch, clipart or quickdraw,
    as Stable Diffusion's plain prompts miss the styles the Espresso paper's clients hold);
  - a local folder in the SD-1.5 layout (unet/, text_encoder/, tokenizer/, scheduler/, vae/ optional);
  - a Hugging Face hub id of an SD-1.5-layout pipeline ("owner/name").
resolve_prior says which kind a spec is and where it lives, without loading anything; load_prior
loads it through pipeline.load_components; load_or_build_prior is the server's variant, which
builds a missing tiny prior. The tiny package is imported only when a spec names it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager

import torch

from .pipeline import Prior, load_components

log = logging.getLogger("fedapp")

ALLOWED = ("allowed: 'tiny', 'tiny:<dataset>', 'tiny-sd', 'tiny-sd:<dataset>' (each + '@<domain>[+<domain>...]'), "
           "a local folder with unet/, text_encoder/, tokenizer/, "
           "scheduler/ (vae/ optional), or a Hugging Face id such as 'runwayml/stable-diffusion-v1-5'")
REQUIRED = ("unet", "text_encoder", "tokenizer", "scheduler")  # vae/ is optional: pixel space without it


@dataclass(frozen=True)
class PriorSource:
    kind: str  # "tiny", "folder" or "hub"
    location: str  # the folder (tiny: its cache folder, which may not be built yet) or the hub id
    dataset: str | None = None  # tiny: the dataset it is trained on
    domains: tuple[str, ...] | None = None  # tiny: the domains of its training images (None: all)
    latent: bool = False  # tiny-sd: a latent prior (VAE + UNet on 8x8x4 latents of 32 px images)

    @property
    def folder(self) -> Path | None:
        """The local folder the prior loads from (and whose weights can be shipped); None for a hub id."""
        return None if self.kind == "hub" else Path(self.location)


def tiny_image_size(dataset: str, latent: bool = False) -> int:
    """The size the tiny prior of `dataset` is built at: the dataset's native size (tiny-sd: 32, resized)."""
    from feddata import native_size

    from .tiny.config import LATENT_IMAGE_SIZE

    return LATENT_IMAGE_SIZE if latent else native_size(dataset)


def is_tiny(spec: str | Path) -> bool:
    return str(spec) in ("tiny", "tiny-sd") or str(spec).startswith(("tiny:", "tiny@", "tiny-sd:", "tiny-sd@"))


def _tiny_build_args(dataset: str, latent: bool, domains: tuple[str, ...] | None) -> dict[str, Any]:
    """What build_tiny_prior / tiny_prior_path take besides the dataset, for a tiny(-sd) spec."""
    from .tiny.config import LATENT_CONFIG, TinyVaeConfig

    return {"image_size": tiny_image_size(dataset, latent), "domains": domains,
            **({"config": LATENT_CONFIG, "vae": TinyVaeConfig()} if latent else {})}


def resolve_prior(spec: str | Path, dataset: str | None = None, cache_dir: str | Path | None = None) -> PriorSource:
    """Which kind of prior `spec` names and where it is; a ValueError (listing what is allowed) when it is
    none of them. Nothing is loaded or built; a tiny prior's folder may not exist yet."""
    spec = str(spec)
    if is_tiny(spec):
        from .tiny import DEFAULT_DATASET, tiny_prior_path

        name, _, doms = spec.partition("@")
        kind, _, ds = name.partition(":")
        ds = ds or dataset or DEFAULT_DATASET
        try:
            check_public_split(ds)
            domains = tiny_domains(ds, doms) if "@" in spec else None
        except ValueError as err:
            raise ValueError(f"prior={spec!r}: {err}") from None
        # tiny: built at the dataset's native size (16 for the 8x8 sets, 28 for the MNIST sets); tiny-sd at 32
        latent = kind == "tiny-sd"
        args = _tiny_build_args(ds, latent, domains)
        folder = tiny_prior_path(ds, args.pop("image_size"), cache_dir=cache_dir, **args)
        return PriorSource("tiny", str(folder), ds, domains, latent)
    path = Path(spec).expanduser()
    if path.is_dir():
        missing = [s for s in REQUIRED if not (path / s).is_dir()]
        if missing:
            raise ValueError(f"prior={spec!r}: folder lacks {', '.join(m + '/' for m in missing)}; {ALLOWED}")
        why = vae_unet_mismatch(path)
        if why:
            raise ValueError(f"prior={spec!r}: {why}")
        return PriorSource("folder", str(path))
    # a path-like spec that is no folder is a typo, not a hub id: say so rather than ask the hub
    if spec.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        raise ValueError(f"prior={spec!r}: no such folder and not a known name; {ALLOWED}")
    return PriorSource("hub", spec)


def vae_unet_mismatch(folder: Path) -> str | None:
    """Why the folder's vae/ cannot feed its unet/ (latent channels, latent side), from their configs; None
    when it can or when there is no vae/ (pixel space) or a config is unreadable (from_pretrained says why)."""
    src = PriorSource("folder", str(folder))
    try:
        vae, unet = _config_json(src, "vae"), _config_json(src, "unet")
    except (OSError, ValueError):
        return None
    if vae is None or unet is None:
        return None
    if vae.get("latent_channels") != unet.get("in_channels"):
        return (f"vae/ makes {vae.get('latent_channels')}-channel latents but unet/ takes {unet.get('in_channels')} "
                "channels (latent_channels must equal in_channels)")
    size, side = vae.get("sample_size"), unet.get("sample_size")
    side = side[0] if isinstance(side, (list, tuple)) else side
    size = size[0] if isinstance(size, (list, tuple)) else size
    factor = 2 ** (len(vae.get("block_out_channels", [0])) - 1)
    if isinstance(size, int) and isinstance(side, int) and size // factor != side:
        return (f"vae/ encodes {size} px images to {size // factor}x{size // factor} latents but unet/ has "
                f"sample_size {side} (vae sample_size / {factor} must equal unet sample_size)")
    return None


def check_public_split(dataset: str) -> None:
    """A tiny prior trains on the dataset's public split: a built-in set, a hub alias, or a local folder has
    one here; a bare hub id might not be decodable offline, so it is refused before anything starts."""
    from feddata import DATASETS

    if dataset not in DATASETS and not Path(dataset).expanduser().is_dir():
        raise ValueError(f"dataset {dataset!r} has no public split here to train a tiny prior on; allowed: "
                         f"{', '.join(DATASETS)} or a local dataset folder")


def tiny_domains(dataset: str, spec: str) -> tuple[str, ...]:
    """The domains of `tiny@a+b`, checked against the dataset's (a ValueError names the allowed ones)."""
    from feddata import dataset_info

    from .tiny.train import domain_ids

    domains = tuple(d for d in spec.split("+") if d)
    domain_ids(dataset, domains, dataset_info(dataset).attributes)  # raises on an unknown or empty list
    return domains


def _config_json(src: PriorSource, component: str) -> dict | None:
    """A component's config.json from the folder, or from the local hub cache (downloaded only when
    the hub is reachable); None when the component does not exist (a pixel-space prior has no vae/)."""
    import json

    if src.kind != "hub":
        path = src.folder / component / "config.json"
        return json.loads(path.read_text()) if path.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return json.loads(Path(hf_hub_download(src.location, "config.json", subfolder=component)).read_text())
    except EntryNotFoundError:
        return None


def prior_image_size(spec: str | Path, dataset: str | None = None, cache_dir: str | Path | None = None) -> int:
    """The prior's image size without loading weights: unet sample_size x vae_scale_factor
    (2 ** (len(vae block_out_channels) - 1), 1 in pixel space) -- as Prior.image_size computes it. A tiny
    prior that is not built yet has the size it will be built at."""
    src = resolve_prior(spec, dataset, cache_dir)
    if src.kind == "tiny" and not src.folder.is_dir():
        return tiny_image_size(src.dataset, src.latent)
    unet = _config_json(src, "unet")
    if unet is None:
        raise ValueError(f"prior={str(spec)!r}: no unet/config.json")
    size = unet["sample_size"]
    size = size if isinstance(size, int) else int(size[0])
    vae = _config_json(src, "vae")
    return size * (2 ** (len(vae["block_out_channels"]) - 1) if vae is not None else 1)


SD_GUIDANCE = 7.5  # diffusers' StableDiffusionPipeline default guidance_scale


def prior_guidance(spec: str | Path, dataset: str | None = None, cache_dir: str | Path | None = None) -> float:
    """The prior's own classifier-free guidance scale: samplers.DEFAULT_GUIDANCE for a
    built-in tiny prior (one scale for every build; docs/priors.md has each build's readings by scale),
    Stable Diffusion's 7.5 for any other pipeline."""
    from .samplers import DEFAULT_GUIDANCE

    src = resolve_prior(spec, dataset, cache_dir)
    built_tiny = src.kind != "hub" and (src.folder / "prior_meta.json").is_file()
    return DEFAULT_GUIDANCE if src.kind == "tiny" or built_tiny else SD_GUIDANCE


def prior_up_blocks(spec: str | Path, dataset: str | None = None, cache_dir: str | Path | None = None) -> int:
    """How many decoder up-blocks the prior's UNet has, from its config (no weights loaded)."""
    src = resolve_prior(spec, dataset, cache_dir)
    if src.kind == "tiny" and not src.folder.is_dir():
        from .tiny.config import LATENT_CONFIG, TinyPriorConfig

        return len((LATENT_CONFIG if src.latent else TinyPriorConfig()).block_out_channels)
    unet = _config_json(src, "unet")
    if unet is None:
        raise ValueError(f"prior={str(spec)!r}: no unet/config.json")
    return len(unet["up_block_types"])


def prior_folder(spec: str | Path, dataset: str | None) -> Path | None:
    """The local folder the prior loads from (so its weights can be shipped), None for a hub id."""
    return resolve_prior(spec, dataset).folder


def load_frozen_prior(spec: str, dataset: str | None, device: str) -> Prior:
    """`load_prior`, once per process for a (spec, dataset, device) and the folder it resolves to: a client
    serves many messages (a Ray actor many virtual clients) with the same frozen prior, and loading it
    (configs, tokenizer, weights) costs more than a small client's work. Keyed by the folder too, so that
    `tiny` under another cache root is another prior. The prior's modules are frozen (eval, no gradients)."""
    folder = prior_folder(spec, dataset)
    return _frozen_prior(str(spec), dataset, device, None if folder is None else str(folder))


@functools.lru_cache(maxsize=2)
def _frozen_prior(spec: str, dataset: str | None, device: str, folder: str | None) -> Prior:
    return load_prior(spec, device=device, dataset=dataset)  # `folder`: part of the cache key only


def load_prior(name_or_path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               *, dataset: str | None = None, cache_dir: str | Path | None = None, build: bool = False) -> Prior:
    """Load a prior from a Hugging Face id, a local SD-1.5-layout folder, or `tiny` / `tiny:<dataset>`.

    `tiny` uses `dataset` (default digit-styles) and resolves to its cache folder (tiny/cache.py);
    when that folder is missing it is built if `build`, else a ValueError says how to build it.
    """
    spec = str(name_or_path)
    if build:
        ensure_prior_built(spec, dataset, cache_dir)
    src = resolve_prior(spec, dataset, cache_dir)
    if src.kind == "tiny" and not src.folder.is_dir():
        from .tiny.packaged import install_packaged

        install_packaged(src.folder)
    if src.kind == "tiny" and not src.folder.is_dir():
        raise ValueError(f"prior={spec!r}: the tiny prior for dataset {src.dataset!r} is not built yet at "
                         f"{src.folder}; build it with `python -m fedapp.models.prior.tiny --dataset {src.dataset}"
                         f"{' --latent' if src.latent else ''}`")
    if src.kind != "hub":
        return load_components(src.location, device, dtype)
    try:
        return load_components(src.location, device, dtype)
    except (OSError, ValueError) as e:  # hub unreachable, unknown repo, not an SD layout
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"prior={spec!r}: could not load it from the Hugging Face hub ({first}); {ALLOWED}") from e


def tiny_prior_missing(spec: str | Path, dataset: str | None, cache_dir: str | Path | None = None) -> bool:
    """Whether `spec` names a built-in tiny prior that is neither built yet nor packaged with fedapp
    (folders and hub ids never are)."""
    from .tiny.packaged import packaged_copy

    src = resolve_prior(spec, dataset, cache_dir)
    return src.kind == "tiny" and not (src.folder / "prior_meta.json").is_file() and packaged_copy(src.folder) is None


def ensure_prior_built(spec: str | Path, dataset: str | None, cache_dir: str | Path | None = None,
                       around: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> bool:
    """Build the built-in tiny prior `spec` names when it is missing (once, cached), inside `around()` (e.g. a
    run phase: the build takes minutes); True when it built one. Folders and hub ids are left alone."""
    src = resolve_prior(spec, dataset, cache_dir)
    if src.kind != "tiny" or (src.folder / "prior_meta.json").is_file():
        return False
    from .tiny import build_tiny_prior
    from .tiny.packaged import install_packaged

    if install_packaged(src.folder):  # the package carries this very build (the default experiment's)
        return False

    with around():
        log.info("building the tiny prior for %s (once; cached for later runs)", src.dataset)
        build_tiny_prior(src.dataset, cache_dir=cache_dir, **_tiny_build_args(src.dataset, src.latent, src.domains))
    return True


def load_or_build_prior(spec: str | Path, dataset: str | None, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> Prior:
    """load_prior for whoever may train: the built-in tiny prior is built first when missing."""
    return load_prior(spec, device, dtype, dataset=dataset, build=True)
