"""Build (cached) and evaluate the built-in tiny prior:

    python -m fedapp.models.prior.tiny --dataset digit-styles    # build (cached) + evaluate
    python -m fedapp.models.prior.tiny --dataset digits --no-eval --set lr=3e-3
    python -m fedapp.models.prior.tiny --dataset mnist-5k --latent   # tiny-sd: VAE + UNet on latents, 32 px
    python -m fedapp.models.prior.tiny --dataset digit-styles --package  # + the package's float16 copy (packaged.py)

Writes the prior into its cache folder, its measured figures into prior_meta.json there and, unless
--docs '', the sample grid and figures into docs/results/tiny_prior_<dataset>.png/.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from .cache import VAE_DOMAINS, write_json
from .config import DEFAULT_DATASET, DEFAULT_STEPS, LATENT_CONFIG, LATENT_IMAGE_SIZE, TinyPriorConfig, TinyVaeConfig
from fedapp.prior_evaluation import evaluate_tiny_prior
from .train import build_tiny_prior


def parse_overrides(items: list[str], base=None):
    """["lr=3e-3", "block_out_channels=32,64,64"] -> `base` (a config dataclass, default TinyPriorConfig())
    with those fields replaced."""
    base = base if base is not None else TinyPriorConfig()
    changes: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in {f.name for f in dataclasses.fields(base)}:
            raise ValueError(f"--set {item!r}: unknown key; allowed {[f.name for f in dataclasses.fields(base)]}")
        old = getattr(base, key)
        if isinstance(old, tuple):
            changes[key] = tuple(type(old[0])(v) if old else v for v in value.split(",") if v)
        elif isinstance(old, bool):
            changes[key] = value.lower() in ("1", "true", "yes")
        else:
            changes[key] = type(old)(value)
    return dataclasses.replace(base, **changes)


def auto_threads() -> int:
    """Torch threads for CPU training: all cores, but 1 when other processes already load the machine
    (OpenMP threads on oversubscribed cores slow a step down many times over; docs/priors.md)."""
    cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    return 1 if busy > cores - 0.5 else cores


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fedapp.models.prior.tiny",
                                description="Build (cached) and evaluate the built-in tiny prior.")
    p.add_argument("--dataset", default=DEFAULT_DATASET)
    p.add_argument("--image-size", type=int, default=0, help="0: the dataset's native size (what `tiny` resolves to)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--domains", default=None, help="train on these domains only, e.g. photo or photo+sketch "
                                                    "(what the spec tiny@photo loads)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--docs", default="docs/results", help="folder for the sample grid and figures ('' to skip)")
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: auto from the load)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="override TinyPriorConfig fields (tuning), e.g. --set lr=3e-3 batch_size=128")
    p.add_argument("--latent", action="store_true",
                   help="tiny-sd: an AutoencoderKL, then the UNet on its 8x8x4 latents of 32 px images")
    p.add_argument("--vae-domains", default="all", choices=VAE_DOMAINS,
                   help="with --latent --domains: the VAE's images, every domain's (default: SD's VAE reconstructs "
                        "any style) or only --domains'")
    p.add_argument("--vae-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="with --latent: override TinyVaeConfig fields, e.g. --vae-set steps=3000")
    p.add_argument("--package", action="store_true",
                   help="also write the build's float16 copy into the package (fedapp/models/prior/tiny/packaged/), "
                        "which a fresh machine installs instead of building; for the default experiment's prior")
    a = p.parse_args(argv)
    config = parse_overrides(a.set, LATENT_CONFIG if a.latent else None)
    vae = parse_overrides(a.vae_set, TinyVaeConfig()) if a.latent else None
    torch.set_num_threads(a.threads or auto_threads())
    print(f"torch threads: {torch.get_num_threads()} (load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores)")
    t0 = time.time()
    from feddata import native_size

    size = a.image_size or (LATENT_IMAGE_SIZE if a.latent else native_size(a.dataset))
    domains = None
    if a.domains is not None:
        from fedapp.models.prior.spec import tiny_domains

        try:
            domains = tiny_domains(a.dataset, a.domains)
        except ValueError as err:
            p.error(f"--domains {err}")
    folder = build_tiny_prior(a.dataset, size, a.steps, a.seed, a.cache_dir, config=config, domains=domains, vae=vae,
                              vae_domains=a.vae_domains)
    build_seconds = time.time() - t0
    print(f"prior: {folder} ({build_seconds:.0f} s this call)")
    if a.no_eval:
        if a.package:
            package(folder)
        return
    meta = json.loads((folder / "prior_meta.json").read_text())
    # a latent prior's samples are read at the dataset's native size, by the reader of the pixel prior
    meta.update(evaluate_tiny_prior(folder, a.dataset, seed=a.seed, read_size=native_size(a.dataset)))
    write_json(folder / "prior_meta.json", meta)
    print(f"train {meta['seconds']} s, {meta['steps']} steps, final loss {meta['final_loss']}; "
          f"sample accuracy {meta['sample_accuracy']:.1%} at guidance {meta['sample_guidance']} "
          "(by guidance: "
          + ", ".join(f"{g}: {v['accuracy']:.1%}" for g, v in meta["accuracy_by_guidance"].items()) + ")")
    if a.docs:
        docs = Path(a.docs)
        docs.mkdir(parents=True, exist_ok=True)
        # a domain prior beside the full one, a latent one beside the pixel one
        name = a.dataset + (f"@{'+'.join(sorted(domains))}" if domains else "") + ("-sd" if a.latent else "")
        shutil.copyfile(folder / "samples.png", docs / f"tiny_prior_{name}.png")
        write_json(docs / f"tiny_prior_{name}.json", {"folder": folder.name, **meta})
    if a.package:
        package(folder)


def package(folder: Path) -> None:
    """The build's float16 copy into fedapp's package (packaged.py), with its evaluation when made."""
    from .packaged import package as write_package, packaged_bytes

    copy = write_package(folder)
    print(f"packaged: {copy} ({packaged_bytes(copy) / 1e6:.2f} MB; "
          f"every packaged prior: {packaged_bytes() / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
