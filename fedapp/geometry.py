"""image-size = "auto": the image geometry comes from the run's components, as diffusers' pipelines
take theirs from `unet.config.sample_size` and the VAE's scale factor -- never from a second key kept
in sync by hand."""

from __future__ import annotations


def auto_image_size(uses_prior: bool, prior: str, dataset: str) -> int:
    """The prior's image size (sample_size x vae_scale_factor, read from its configs) for a method with a
    prior (MethodSpec.uses_prior), else the dataset's native size. Raises ValueError when the prior's
    configs cannot be read."""
    if uses_prior:
        from fedapp.models.prior import prior_image_size

        return prior_image_size(prior, dataset)
    from feddata import native_size

    return native_size(dataset)
