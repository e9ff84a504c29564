"""The built-in tiny prior: a pixel-space text-to-image diffusion model in the SD-1.5 layout.

A word-level tokenizer over the prompt vocabulary, a small CLIPTextModel and a small
UNet2DConditionModel (modules.py, sized by config.py), trained jointly on a dataset's public split
(train.py) and saved into a content-addressed cache folder (cache.py), so that
`load_prior("tiny:<dataset>")` loads it through the same from_pretrained code that loads Stable
Diffusion. fedapp.prior_evaluation measures it; `python -m fedapp.models.prior.tiny --dataset digit-styles`
builds and evaluates it. docs/priors.md has what was measured to arrive at the recipe.
packaged.py keeps a float16 copy of the default experiment's build inside the package, installed into
the cache instead of building it on a fresh machine.

This package knows nothing of prior specs (`tiny`, folders, hub ids): spec.py resolves those and
calls in here to build.
"""

from . import packaged
from .cache import cache_root, tiny_prior_path
from .config import CODE_VERSION, DEFAULT_DATASET, DEFAULT_STEPS, TEST_CONFIG, TinyPriorConfig
from .modules import build_modules, build_tokenizer, random_tiny_prior
from .train import build_tiny_prior, public_data, train_tiny_prior

__all__ = ["CODE_VERSION", "DEFAULT_DATASET", "DEFAULT_STEPS", "TEST_CONFIG", "TinyPriorConfig", "build_modules",
           "build_tiny_prior", "build_tokenizer", "cache_root", "public_data",
           "random_tiny_prior", "packaged", "tiny_prior_path", "train_tiny_prior"]
