"""Where built priors live: a content-addressed folder per build, `<root>/<dataset>-<key>`.

The key hashes everything a build depends on (config, dataset, image size, steps, seed, CODE_VERSION,
replacement data), so a changed recipe lands in a new folder and an old folder is never reused for
it. The key's bytes must stay as they are: existing caches (and the folder names the docs cite)
resolve only while the same facts hash to the same digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from ...cache import cache_home, facts_digest
from .config import CODE_VERSION, DEFAULT_IMAGE_SIZE, DEFAULT_STEPS, TinyPriorConfig, TinyVaeConfig


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Folder holding prior folders: cache_dir, else $FEDAPP_CACHE/priors, else ~/.cache/fedapp/priors."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return cache_home() / "priors"


def _key(dataset: str, image_size: int, steps: int, seed: int, config: TinyPriorConfig, data_hash: str = "",
         domains: tuple[str, ...] | None = None, vae: TinyVaeConfig | None = None, vae_domains: str = "all") -> str:
    facts = {"config": asdict(config), "dataset": dataset, "image_size": image_size, "steps": steps, "seed": seed,
             "code": CODE_VERSION, "data": data_hash}
    if domains is not None:  # only then: a prior of all domains keeps the key (and folder) it always had
        facts["domains"] = sorted(domains)
    if vae is not None:  # tiny-sd; pixel priors keep their keys
        facts["vae"] = asdict(vae)
        if domains is not None:  # which images its autoencoder saw (the UNet: `domains`)
            facts["vae_domains"] = check_vae_domains(vae_domains)
    return facts_digest(facts)


VAE_DOMAINS = ("all", "same")


def check_vae_domains(value: str) -> str:
    """`all`: a latent prior of some domains still has an autoencoder of every domain's public images, as
    Stable Diffusion's VAE reconstructs any style and only its text-to-image UNet lacks a style's prompt;
    `same`: the VAE too sees only `domains` (measured: it cannot then reconstruct the others, docs/espresso.md)."""
    if value not in VAE_DOMAINS:
        raise ValueError(f"vae_domains={value!r}: allowed {', '.join(VAE_DOMAINS)}")
    return value


def hash_data(x: torch.Tensor, y: torch.Tensor, class_names: list[str]) -> str:
    """12 hex digits of the data's contents, for builds on data other than feddata's public split."""
    h = hashlib.sha256(x.contiguous().numpy().tobytes() + y.numpy().tobytes())
    h.update("|".join(class_names).encode())
    return h.hexdigest()[:12]


def tiny_prior_path(dataset: str, image_size: int = DEFAULT_IMAGE_SIZE, steps: int = DEFAULT_STEPS, seed: int = 0,
                    cache_dir: str | Path | None = None, config: TinyPriorConfig | None = None,
                    data_hash: str = "", domains: tuple[str, ...] | None = None,
                    vae: TinyVaeConfig | None = None, vae_domains: str = "all") -> Path:
    """The cache folder `<root>/<dataset>-<hash>` of that build (it may not exist yet); a prior trained
    on some domains only is `<root>/<dataset>@<domain>+...-<hash>`; a latent one (tiny-sd, with `vae`)
    `<root>/<dataset>[@...]-sd-<hash>`, its key saying which images its VAE saw (`vae_domains`)."""
    config = config or TinyPriorConfig()
    name = dataset + (f"@{'+'.join(sorted(domains))}" if domains is not None else "") + ("-sd" if vae else "")
    key = _key(dataset, image_size, steps, seed, config, data_hash, domains, vae, vae_domains)
    return cache_root(cache_dir) / f"{name}-{key}"


def write_json(path: Path, obj) -> None:
    """Write through a temporary file and a rename, so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def publish(folder: Path, write: Callable[[Path], None]) -> Path:
    """Fill a temporary sibling of `folder` with write(tmp), then rename it to `folder`: a reader sees the
    whole folder or none, and when another process published it first, theirs is kept."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, folder)
    except OSError:  # another process won the race: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
