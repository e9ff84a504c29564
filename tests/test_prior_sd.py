"""The Stable Diffusion path: a tiny SD-1.5-layout pipeline built here, saved, loaded with load_prior."""

import json

import pytest
import torch
from diffusers import DDIMScheduler, PNDMScheduler, StableDiffusionPipeline

from fedapp.models.prior import load_prior
from fedapp.models.prior.sd_layout import random_sd_pipeline
from fedapp.models.prior.samplers import SamplerSettings, expected_unet_evals

PROMPTS = ["a photo of the digit three", "a photo of the digit seven"]


def tiny_sd_pipeline(tmp_path) -> StableDiffusionPipeline:
    """SD-1.5 layout at toy size: VAE 32x32 -> 4x16x16 latents, CLIP text 32-d, BPE tokenizer from files."""
    return random_sd_pipeline(tmp_path, image_size=32, levels=2)


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sd")
    pipe = tiny_sd_pipeline(tmp)
    pipe.save_pretrained(tmp / "pipeline")
    return pipe, tmp / "pipeline"


def test_load_prior_from_sd_folder(sd):
    _, folder = sd
    prior = load_prior(folder)
    assert prior.vae is not None
    assert prior.latent_shape == (4, 16, 16) and prior.image_size == 32 and prior.cond_shape == (77, 32)
    assert prior.steps_offset == 1 and prior.clip_sample is None
    assert torch.allclose(prior.alphas_cumprod,
                          PNDMScheduler.from_pretrained(folder, subfolder="scheduler").alphas_cumprod)


def test_encode_sample_decode_shapes(sd):
    _, folder = sd
    prior = load_prior(folder)
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    z = prior.encode_images(x)
    assert z.shape == (2, 4, 16, 16) and torch.isfinite(z).all()
    back = prior.decode_latents(z)
    assert back.shape == x.shape and back.abs().max() <= 1
    cond = prior.encode_prompts(PROMPTS)
    assert cond.shape == (2, 77, 32)
    for c in (PROMPTS, cond):  # prompts, and raw condition embeddings bypassing the text encoder
        out = prior.sample(torch.randn(2, 4, 16, 16), c, SamplerSettings(num_steps=4, guidance=3.0))
        assert out.images.shape == (2, 3, 32, 32) and out.latents.shape == (2, 4, 16, 16)
        assert torch.isfinite(out.images).all() and out.unet_evals == 8
    zz = prior.sample(2, cond, SamplerSettings(num_steps=5, guidance=3.0, sampler="zigzag", zigzag_t=600),
                      generator=torch.Generator().manual_seed(0))
    assert zz.unet_evals == expected_unet_evals(5, 600, 3.0, 0.0, steps_offset=1)
    assert torch.isfinite(zz.images).all()
    # noise at t with the SD encoder, then predict it back: shapes/finite through the latent path
    t = torch.tensor([10, 900])
    eps = torch.randn_like(z)
    assert torch.isfinite(prior.predict_noise(prior.add_noise(z, eps, t), t, cond, guidance=2.0)).all()


def test_sampling_matches_stable_diffusion_pipeline_with_ddim(sd):
    """Our DDIM loop with CFG against StableDiffusionPipeline + DDIMScheduler on the same latents."""
    pipe, folder = sd
    prior = load_prior(folder)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, clip_sample=False)  # as SD-1.5's file says
    noise = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    ours = prior.sample(noise, PROMPTS, SamplerSettings(num_steps=5, guidance=4.0))
    theirs = pipe(PROMPTS, num_inference_steps=5, guidance_scale=4.0, latents=noise.clone(), output_type="latent",
                  eta=0.0).images
    assert torch.allclose(ours.latents, theirs, atol=1e-4, rtol=1e-4)


def test_features_on_sd_prior(sd):
    from fedapp.models.features import UNetFeatureExtractor

    _, folder = sd
    prior = load_prior(folder)
    fx = UNetFeatureExtractor(prior, t=261, prompt="a photo of the digit three")
    out = fx.features(torch.rand(3, 3, 32, 32) * 2 - 1)
    assert fx.up_blocks == (0, 1)  # this toy UNet has 2 up-blocks; SD-1.5 has 4 -> (1, 2, 3)
    assert out.features.shape == (3, 32 + 16) and [b.shape[1] for b in out.blocks] == [32, 16]


# ---- the prior decides the geometry; an SD-layout prior end to end ---------------------------------------
def test_image_size_auto_comes_from_the_prior_and_a_conflict_is_one_line(sd, tmp_path):
    from fedapp.config import ConfigError, all_defaults
    from fedapp.models.prior import prior_image_size, prior_up_blocks
    from fedapp.simulation import resolve_run_config

    _, folder = sd
    assert prior_image_size(folder) == 32 and prior_up_blocks(folder) == 2  # read from configs, no weights
    flat, _ = resolve_run_config({"method": "espresso", "prior": str(folder), "out-dir": str(tmp_path)}, 2)
    assert flat["image-size"] == "auto"
    from fedapp.config import parse_run_config

    assert parse_run_config({**all_defaults(), **flat}).flat()["image-size"] == 32  # what messages carry
    with pytest.raises(ConfigError) as err:
        resolve_run_config({"method": "espresso", "prior": str(folder), "image-size": 16, "out-dir": str(tmp_path)}, 2)
    assert str(err.value) == f"image-size=16: prior={str(folder)!r} makes 32x32 images; must be 'auto' or 32"
    from fedapp.models.prior import prior_guidance

    assert prior_guidance(folder) == 7.5 and prior_guidance("tiny", "digits") == 3.0  # the prior's own CFG scale
    with pytest.raises(ConfigError, match=r"espresso.gamma2=8.0: must be < espresso.gamma1 \(auto: 7.5"):
        resolve_run_config({"method": "espresso", "prior": str(folder), "espresso.gamma2": 8.0,
                            "out-dir": str(tmp_path)}, 2)
    with pytest.raises(ConfigError, match=r"feddifrc.up-blocks='2': prior=.* has up-blocks 0..1"):
        resolve_run_config({"method": "feddifrc", "prior": str(folder), "feddifrc.up-blocks": "2",
                            "out-dir": str(tmp_path)}, 2)


SD_FAST = {"dataset": "digit-styles", "partitioner.name": "domain", "partitioner.per-class": 2, "min-clients": 2,
           "server-epochs": 1, "espresso.embed-steps": 2, "espresso.mixup-pairs": 8, "espresso.steps": 2,
           "espresso.ratio": 1.0, "espresso.synth-batch": 16, "espresso.clusters": 2, "espresso.gmm-components": 2,
           "espresso.zigzag-t": 300, "num-server-rounds": 1, "local-epochs": 1,
           "feddifrc.pca-fit": "client"}  # each client fits its basis on its 20 images, not 128 public ones


@pytest.mark.parametrize("method", ["espresso", "prompts", "feddifrc"])
def test_sd_layout_prior_end_to_end_on_32px(sd, tmp_path, method):
    """A saved SD-1.5-layout pipeline (a VAE with 2x downsampling: 32 px images, 4x16x16 latents) as
    `prior=<folder>` through the in-process simulation (the same server and ClientApp handlers as on Ray,
    without Ray's start-up: each method's own end-to-end test covers Ray): uploads pass validation, the
    server synthesises (one-shot) or the clients train with its decoder features (FedDifRC), summary.json
    is complete."""
    from fedapp.simulation import simulate_in_process

    _, folder = sd
    s = simulate_in_process({"method": method, "prior": str(folder), "out-dir": str(tmp_path), **SD_FAST},
                            num_clients=2)
    assert s["status"] == "completed" and s["failures"] == [], s.get("failures")
    m = s["metrics"]
    assert 0.0 <= m["accuracy"] <= 1.0 and set(m["per_client_accuracy"]) == {"0", "1"}
    config = json.loads((tmp_path / s["run_dir"].split("/")[-1] / "config.json").read_text())
    assert config["image-size"] == 32
    if method != "feddifrc":
        assert m["num_synthetic"] == 2 * 20 and m["unet_evals_per_image"] > 0
        assert m["options"]["gamma1"] == 7.5  # auto: Stable Diffusion's own guidance, not the tiny prior's
    else:
        assert m["representation_cache_bytes_total"] > 0
