"""Prior API on a tiny random pixel prior: conditions, noise prediction, the training objective."""

import pytest
import torch
from diffusers import DDIMScheduler

from fedapp.models.prior import Prior, diffusion_target
from fedapp.models.prior.samplers import SamplerSettings
from fedapp.models.prior.tiny import TEST_CONFIG, random_tiny_prior

PROMPT = "a photo of the digit three"


@pytest.fixture(scope="module")
def prior():
    return random_tiny_prior(TEST_CONFIG)


def test_shapes_and_conditions(prior):
    L, D = prior.cond_shape
    assert prior.latent_shape == (3, 16, 16) and prior.image_size == 16 and (L, D) == (8, 32)
    assert prior.prediction_type == "v_prediction" and prior.clip_sample == 1.0
    c = prior.encode_prompts([PROMPT, ""])
    assert c.shape == (2, L, D)
    assert torch.allclose(prior.null_condition(3), c[1:].expand(3, -1, -1))
    assert prior.condition(PROMPT, 4).shape == (4, L, D)  # one prompt broadcast
    assert prior.condition(c[:1], 5).shape == (5, L, D)  # one raw condition broadcast
    with pytest.raises(ValueError, match="condition of shape"):
        prior.condition(torch.zeros(2, L, D + 1), 2)
    with pytest.raises(ValueError, match="sampler"):
        prior.sample(1, PROMPT, SamplerSettings(sampler="euler"))


def test_v_prediction_is_converted_to_eps(prior):
    z, t = torch.randn(2, 3, 16, 16), 700
    cond = prior.encode_prompts([PROMPT] * 2)
    v = prior.unet(z, torch.tensor([t, t]), encoder_hidden_states=cond).sample
    a = prior.alphas_cumprod[t]
    with torch.no_grad():
        eps = prior.predict_noise(z, t, cond)
    assert torch.allclose(eps, a.sqrt() * v + (1 - a).sqrt() * z, atol=1e-5)


def test_loss_is_the_native_objective_and_reaches_raw_conditions(prior):
    z0 = torch.rand(3, 3, 16, 16) * 2 - 1
    noise, t = torch.randn(3, 3, 16, 16), torch.tensor([50, 400, 900])
    cond = prior.encode_prompts([PROMPT] * 3).clone().requires_grad_(True)
    loss = prior.loss(z0, cond, t=t, noise=noise)
    a = prior.alphas_cumprod[t].view(-1, 1, 1, 1)
    out = prior.unet(prior.add_noise(z0, noise, t), t, encoder_hidden_states=cond).sample
    assert torch.allclose(loss, torch.nn.functional.mse_loss(out, a.sqrt() * noise - (1 - a).sqrt() * z0))
    loss.backward()
    assert cond.grad is not None and cond.grad.abs().sum() > 0  # Espresso learns c through the frozen prior
    assert all(p.grad is None for p in prior.unet.parameters())  # the prior itself stays frozen
    # an eps-prior's loss is E||eps - eps_theta||^2
    eps_prior = Prior(prior.tokenizer, prior.text_encoder, prior.unet, DDIMScheduler(clip_sample=False))
    with torch.no_grad():
        l_eps = eps_prior.loss(z0, cond, t=t, noise=noise)
        eps_hat = eps_prior.predict_noise(eps_prior.add_noise(z0, noise, t), t, cond)
    assert torch.allclose(l_eps, torch.nn.functional.mse_loss(eps_hat, noise))
    assert torch.equal(diffusion_target("sample", z0, noise, a), z0)


def test_geometry_comes_from_the_component_configs_and_images_are_resized_to_it(prior, tmp_path):
    from test_prior_sd import tiny_sd_pipeline  # the SD-1.5 layout at toy size, with a VAE

    assert prior.vae is None and prior.vae_scale_factor == 1 and prior.sample_size == 16
    assert prior.image_size == 16 and prior.latent_shape == (3, 16, 16)
    pipe = tiny_sd_pipeline(tmp_path)
    sd = Prior(pipe.tokenizer, pipe.text_encoder, pipe.unet, pipe.scheduler, pipe.vae)
    assert sd.vae_scale_factor == 2 and sd.sample_size == 16  # VAE blocks (8, 16): one 2x down-sampling
    assert sd.image_size == 32 and sd.latent_shape == (4, 16, 16) and sd.cond_shape == (77, 32)
    # any image size in, the prior's image_size out; images already at that size pass unchanged
    x = torch.rand(2, 3, 28, 28) * 2 - 1
    assert prior.prepare_images(x).shape == (2, 3, 16, 16) and sd.prepare_images(x).shape == (2, 3, 32, 32)
    assert prior.prepare_images(x).abs().max() <= 1
    assert torch.allclose(prior.prepare_images(torch.full((1, 3, 28, 28), 0.5)), torch.tensor(0.5))
    assert torch.equal(prior.prepare_images(x[..., :16, :16]), x[..., :16, :16])
    # encode_images resizes first, so latents always have the prior's latent_shape
    assert prior.encode_images(x).shape == (2, *prior.latent_shape)
    assert sd.encode_images(x).shape == (2, *sd.latent_shape)


def test_loading_a_prior_prints_nothing(prior, tmp_path, capfd):
    """No third-party advice or progress bars in a federation's log: loading a saved prior (what every
    client does) writes nothing to stdout/stderr and raises no warning."""
    import warnings

    from fedapp.models.prior import load_prior

    import gc

    folder = prior.save_pretrained(tmp_path / "prior")
    with warnings.catch_warnings():  # files leaked by earlier tests (Ray's /dev/null) are closed now, not
        warnings.simplefilter("ignore", ResourceWarning)  # mid-load as a warning that loading did not raise
        gc.collect()
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_prior(folder)
    out, err = capfd.readouterr()
    assert (out, err) == ("", "") and [str(w.message) for w in caught] == []
    assert loaded.image_size == prior.image_size
