"""fedapp's diffusion toolkit: priors (tiny or Stable Diffusion), samplers, features, small nets.

Names are imported lazily so that `import fedapp.models` stays cheap (diffusers/transformers load
only when a prior or network is used).
"""

from importlib import import_module

_EXPORTS = {
    "Prior": "prior", "SampleResult": "prior", "load_prior": "prior",
    "prior_to_records": "prior", "prior_from_records": "prior",
    "expected_unet_evals": "prior", "leading_timesteps": "prior",
    "UNetFeatureExtractor": "features", "VisionBackboneExtractor": "features",
    "make_feature_extractor": "features", "FeatureOutput": "features",
    "TinyPriorConfig": "prior.tiny", "build_tiny_prior": "prior.tiny", "tiny_prior_path": "prior.tiny",
    "random_tiny_prior": "prior.tiny",
    "SmallCNN": "classifier", "train_classifier": "classifier",
    "DDPM": "ddpm", "VelocityNet": "flow",
    "class_prompt": "text", "class_prompts": "text",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
