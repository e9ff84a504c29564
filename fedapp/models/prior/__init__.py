"""The diffusion prior, laid out as a diffusers-style package.

    pipeline.py   Prior: frozen tokenizer + CLIP text encoder + UNet + DDIM schedule (+ VAE); its loader
    samplers.py   the DDIM and Z-sampling loops, with the notation of their equations
    spec.py       what a `prior` spec names (tiny, a folder, a hub id) and loading it
    shipping.py   a prior folder as bytes in a message, and back
    tiny/         the built-in tiny prior: config, modules, cache, training, evaluation, CLI

Imports run one way only: samplers <- pipeline <- tiny <- spec / shipping; pipeline knows neither tiny
nor specs, and tiny knows no specs.
"""

from .pipeline import Condition, Prior, SampleResult, diffusion_target, load_components, save_components
from .samplers import DEFAULT_GAMMA2, DEFAULT_GUIDANCE, DEFAULT_ZIGZAG_T, expected_unet_evals, leading_timesteps
from .shipping import cached_shipped, prior_from_records, prior_to_records, records_digest
from .spec import (PriorSource, ensure_prior_built, is_tiny, load_frozen_prior, load_or_build_prior, load_prior,
                   prior_folder, prior_guidance, prior_image_size, prior_up_blocks, resolve_prior, tiny_prior_missing)
from .tiny.config import DEFAULT_DATASET as DEFAULT_TINY_DATASET

__all__ = ["DEFAULT_GAMMA2", "DEFAULT_GUIDANCE", "DEFAULT_TINY_DATASET", "DEFAULT_ZIGZAG_T", "Condition", "Prior",
           "PriorSource", "SampleResult", "diffusion_target", "expected_unet_evals", "is_tiny", "leading_timesteps",
           "ensure_prior_built", "load_components", "load_or_build_prior", "load_prior", "prior_folder",
           "prior_guidance", "prior_image_size", "prior_up_blocks", "prior_from_records", "prior_to_records",
           "resolve_prior", "save_components", "tiny_prior_missing", "cached_shipped", "records_digest",
           "load_frozen_prior"]
