"""The diffusion prior, laid out as a diffusers-style package.

    pipeline.py   Prior: frozen tokenizer + CLIP text encoder + UNet + DDIM schedule (+ VAE); its loader
    samplers.py   the DDIM and Z-sampling loops, with the notation of their equations
    spec.py       what a `prior` spec names (tiny, a folder, a hub id) and loading it
    shipping.py   a prior folder as bytes in a message, and back
    tiny/         the built-in tiny prior: config, modules, cache, training, evaluation, CLI

Imports run one way only: samplers <- pipeline <- tiny <- spec / shipping; pipeline knows neither tiny
nor specs, and tiny knows no specs.

The names below load their module on first use (PEP 562): every ClientApp process imports every method's
protocol module, and Espresso's reads the sampler's constants from samplers.py, which must not bring the
pipeline, the tiny prior's training code and the shipping code along (benchmarks/deployed_message.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as the type checker sees them; at run time each loads on first use (below)
    from .pipeline import (Condition, Prior, SampleResult, diffusion_target, load_components,  # noqa: F401
                           save_components)
    from .samplers import (DEFAULT_GAMMA2, DEFAULT_GUIDANCE, DEFAULT_ZIGZAG_T, expected_unet_evals,  # noqa: F401
                           leading_timesteps)
    from .shipping import cached_shipped, prior_from_records, prior_to_records, records_digest  # noqa: F401
    from .spec import (PriorSource, ensure_prior_built, is_tiny, load_frozen_prior, load_or_build_prior,  # noqa: F401
                       load_prior, prior_folder, prior_guidance, prior_image_size, prior_up_blocks, resolve_prior,
                       tiny_prior_missing)
    from .tiny.config import DEFAULT_DATASET as DEFAULT_TINY_DATASET  # noqa: F401

_EXPORTS = {  # name -> (module, its name there)
    **{n: ("pipeline", n) for n in ("Condition", "Prior", "SampleResult", "diffusion_target", "load_components",
                                    "save_components")},
    **{n: ("samplers", n) for n in ("DEFAULT_GAMMA2", "DEFAULT_GUIDANCE", "DEFAULT_ZIGZAG_T", "expected_unet_evals",
                                    "leading_timesteps")},
    **{n: ("shipping", n) for n in ("cached_shipped", "prior_from_records", "prior_to_records", "records_digest")},
    **{n: ("spec", n) for n in ("PriorSource", "ensure_prior_built", "is_tiny", "load_frozen_prior",
                                "load_or_build_prior", "load_prior", "prior_folder", "prior_guidance",
                                "prior_image_size", "prior_up_blocks", "resolve_prior", "tiny_prior_missing")},
    "DEFAULT_TINY_DATASET": ("tiny.config", "DEFAULT_DATASET"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(f".{module}", __name__), attr)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
