"""tiny-sd: a latent tiny prior (AutoencoderKL + CLIP text encoder + UNet on 8x8x4 latents), built here on a
small configuration, loaded through the SD-1.5 code path and by diffusers' own StableDiffusionPipeline, and
run end to end by the methods that use a prior. Its bad specs fail in one line."""

import json

import pytest
import torch

from fedapp.models.prior import load_prior
from fedapp.models.prior.samplers import SamplerSettings
from fedapp.models.prior.spec import prior_image_size, prior_up_blocks, resolve_prior
from fedapp.models.prior.tiny import TEST_CONFIG, build_tiny_prior, tiny_prior_path
from fedapp.models.prior.tiny.config import LATENT_CONFIG, TEST_VAE_CONFIG, TinyVaeConfig
from fedapp.models.prior.tiny.vae import encode_means, train_vae

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
PROMPTS = ["a photo of the digit three", "a photo of the digit seven"]


def bars(n=40, size=32, seed=0):
    """Class c: a bright bar at row band c of a dark image (learnable structure at 32 px)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 10
    x = torch.full((n, 3, size, size), -0.9) + 0.05 * torch.randn(n, 3, size, size, generator=g)
    for i, c in enumerate(y.tolist()):
        x[i, :, 3 * c:3 * c + 3, 4:28] = 0.9
    return x, y, NAMES


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    folder = build_tiny_prior("digits", 32, steps=4, cache_dir=cache, progress=False, config=TEST_CONFIG,
                              data=bars(), vae=TEST_VAE_CONFIG)
    return cache, folder


def test_build_writes_the_sd_layout_with_a_vae_and_loads_as_a_latent_prior(built):
    cache, folder = built
    assert folder.name.startswith("digits-sd-")
    assert sorted(p.name for p in folder.iterdir()) == ["model_index.json", "prior_meta.json", "scheduler",
                                                        "text_encoder", "tokenizer", "unet", "vae"]
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline" and index["vae"] == ["diffusers", "AutoencoderKL"]
    meta = json.loads((folder / "prior_meta.json").read_text())
    assert meta["latent"] and meta["vae_steps"] == TEST_VAE_CONFIG.steps and meta["scaling_factor"] > 0
    prior = load_prior(folder)
    # the geometry comes from the configs: 3 VAE blocks = 4x downsampling, 8x8 latents of 32 px images
    assert prior.vae is not None and prior.vae_scale_factor == 4 and prior.latent_shape == (4, 8, 8)
    assert prior.image_size == 32 and prior_image_size(folder) == 32
    assert prior.clip_sample is None and prior.steps_offset == 1  # latents unclipped, SD-1.5's offset
    assert prior.scaling_factor == pytest.approx(meta["scaling_factor"], abs=5e-6)  # meta rounds to 5 decimals
    # the UNet trained on scaled posterior means: the public images' latents have unit spread
    x = bars()[0]
    z = prior.encode_images(x)
    assert z.shape == (40, 4, 8, 8) and float(z.std()) == pytest.approx(1.0, rel=1e-3)
    assert prior.decode_latents(z).shape == (40, 3, 32, 32)
    # a new VAE recipe is a new cache folder; the pixel prior's key is untouched by the vae field
    assert tiny_prior_path("digits", 32, 4, cache_dir=cache, config=TEST_CONFIG, vae=TinyVaeConfig()) != folder
    assert "-sd-" not in tiny_prior_path("digits", 16, cache_dir=cache).name


def test_diffusers_pipeline_loads_the_folder_and_decodes_the_same_images(built):
    from diffusers import StableDiffusionPipeline

    _, folder = built
    prior = load_prior(folder)
    pipe = StableDiffusionPipeline.from_pretrained(str(folder), safety_checker=None, requires_safety_checker=False)
    assert pipe.unet.config.sample_size * pipe.vae_scale_factor == 32  # the size comes from the folder's configs
    noise = torch.randn(2, *prior.latent_shape, generator=torch.Generator().manual_seed(1))
    ours = prior.sample(noise, PROMPTS, SamplerSettings(num_steps=5, guidance=2.0)).images
    theirs = pipe(PROMPTS, latents=noise.clone(), num_inference_steps=5, guidance_scale=2.0, output_type="pt",
                  height=32, width=32).images * 2 - 1  # [0, 1] -> [-1, 1]
    assert ours.shape == theirs.shape == (2, 3, 32, 32)
    assert (ours - theirs).abs().max() < 1e-4  # float rounding of the same DDIM steps and decoder


def test_evaluating_a_latent_build_reads_its_vae_reconstructions_beside_the_originals(built):
    from fedapp.prior_evaluation import evaluate_tiny_prior

    _, folder = built
    x, y, names = bars(n=20, seed=1)
    out = evaluate_tiny_prior(folder, "digits", per_class=1, guidances=(2.0,), num_steps=2, data=bars(),
                              test=(x, y), classifier_epochs=1)
    assert 0 <= out["vae_reconstruction_accuracy"] <= 1 and out["vae_reconstruction_mse"] > 0
    assert out["vae_original_accuracy"] == pytest.approx(out["reference_test_accuracy"], abs=1e-4)
    assert (folder / "samples.png").is_file()


def test_domain_readings_read_the_vae_round_trip_and_say_which_style_samples_are_drawn_in(built):
    """On a dataset with styles, a domain reader reads the prior's VAE round trip against the originals and
    says which style each sample is in: here the 'samples' are real held-out sketches, so sketch dominates."""
    from fedapp.prior_evaluation import domain_readings
    from fedapp.models.prior.tiny.train import server_split

    _, folder = built
    prior = load_prior(folder)
    test = server_split("digit-styles", 16, 0).test
    sketches = test.x[torch.as_tensor(test.attrs["domain"]) == 1][:40]
    out = domain_readings(prior, "digit-styles", sketches, {"seed": 0, "image_size": 32}, seed=0, epochs=1,
                          read_size=16)
    readers = out.pop("_readers")
    assert [r.attribute for r in readers] == ["domain"]
    assert out["domain_reader_test_accuracy"] == pytest.approx(readers[0].held_out_accuracy, abs=1e-4)
    assert readers[0].held_out_accuracy > 0.9
    assert list(out["sample_domains"]) == ["photo", "sketch", "clipart", "quickdraw"]
    assert sum(out["sample_domains"].values()) == pytest.approx(1.0, abs=1e-3)
    assert max(out["sample_domains"], key=out["sample_domains"].get) == "sketch"
    # the test build's VAE trained for a few steps: its round trip loses the style the originals show
    assert out["vae_original_domain_accuracy"] > 0.9 > out["vae_reconstruction_domain_accuracy"]
    assert domain_readings(prior, "digits", sketches, {"seed": 0, "image_size": 32}, 0, 1, 16) == {}


def test_the_vae_learns_to_reconstruct_and_scales_its_latents_to_unit_spread():
    x = bars(n=32)[0]
    untrained, _ = train_vae(x, TinyVaeConfig(block_out_channels=(8, 16, 16), norm_num_groups=4, steps=1,
                                              batch_size=16), progress=False)
    vae, facts = train_vae(x, TinyVaeConfig(block_out_channels=(8, 16, 16), norm_num_groups=4, steps=60,
                                            batch_size=16, lr=3e-3), progress=False)

    def mse(v):
        with torch.no_grad():
            return float((v.decode(encode_means(v, x)).sample - x).pow(2).mean())

    assert mse(vae) < 0.5 * mse(untrained)
    assert float((encode_means(vae, x) * vae.config.scaling_factor).std()) == pytest.approx(1.0, rel=1e-3)
    assert facts["vae_steps"] == 60 and facts["vae_final_mse"] > 0


def test_tiny_sd_specs_resolve_to_a_latent_cache_folder_of_32_px():
    src = resolve_prior("tiny-sd", "mnist-5k")
    assert src.kind == "tiny" and src.latent and src.dataset == "mnist-5k"
    assert src.folder.name.startswith("mnist-5k-sd-")
    assert resolve_prior("tiny-sd:mnist-styles@photo").folder.name.startswith("mnist-styles@photo-sd-")
    assert not resolve_prior("tiny:mnist-5k").latent
    if not src.folder.is_dir():  # not built on this machine: the size and blocks it will be built with
        assert prior_image_size("tiny-sd", "mnist-5k") == 32
        assert prior_up_blocks("tiny-sd", "mnist-5k") == len(LATENT_CONFIG.block_out_channels)


@pytest.mark.parametrize("spec, message", [
    ("tiny-sd:nope/nothing", "prior='tiny-sd:nope/nothing': dataset 'nope/nothing' has no public split here"),
    ("tiny-sd:mnist-styles@oil", "prior='tiny-sd:mnist-styles@oil': domains 'oil': allowed one or more of photo"),
    ("tiny-sd:digits@photo", "prior='tiny-sd:digits@photo': domains 'photo': dataset 'digits' has no domains"),
])
def test_a_bad_tiny_sd_spec_is_one_line(spec, message):
    with pytest.raises(ValueError) as err:
        resolve_prior(spec)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("field, value, message", [
    ("latent_channels", 3, "vae/ makes 3-channel latents but unet/ takes 4 channels"),
    ("sample_size", 64, "vae/ encodes 64 px images to 16x16 latents but unet/ has sample_size 8"),
])
def test_a_folder_whose_vae_does_not_fit_its_unet_is_refused_in_one_line(built, tmp_path, field, value, message):
    import shutil

    from fedapp.config import ConfigError
    from fedapp.simulation import resolve_run_config

    _, folder = built
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "vae" / "config.json").read_text())
    (bad / "vae" / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ValueError, match=message):
        resolve_prior(str(bad))
    with pytest.raises(ConfigError) as err:  # before anything starts
        resolve_run_config({"method": "espresso", "prior": str(bad), "out-dir": str(tmp_path)}, 2)
    assert message in str(err.value) and "\n" not in str(err.value)


FAST = {"dataset": "digit-styles", "partitioner.name": "domain", "partitioner.per-class": 2, "min-clients": 2,
        "server-epochs": 1, "espresso.embed-steps": 2, "espresso.mixup-pairs": 8, "espresso.steps": 2,
        "espresso.ratio": 1.0, "espresso.synth-batch": 16, "espresso.clusters": 2, "espresso.gmm-components": 2,
        "espresso.zigzag-t": 300, "num-server-rounds": 1, "local-epochs": 1}


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("method", ["espresso", "feddifrc"])
def test_every_prior_method_runs_on_a_tiny_sd_build(built, tmp_path, method):
    """Espresso's conditions and GMMs on VAE latents (8x8x4), FedDifRC's features from the latent UNet's
    up-blocks: both complete at 32 px on the small build, in process."""
    from fedapp.simulation import simulate_in_process

    _, folder = built
    s = simulate_in_process({"method": method, "prior": str(folder), "out-dir": str(tmp_path), **FAST}, 2)
    assert s["status"] == "completed" and s["failures"] == [], s.get("failures")
    m = s["metrics"]
    assert 0.0 <= m["accuracy"] <= 1.0
    config = json.loads((tmp_path / s["run_dir"].split("/")[-1] / "config.json").read_text())
    assert config["image-size"] == 32  # auto: the prior's size
    if method == "espresso":
        assert m["num_synthetic"] == 2 * 20 and m["unet_evals_per_image"] > 0
    else:
        assert m["representation_cache_bytes_total"] > 0


def test_a_domain_latent_prior_trains_its_vae_on_every_domain_and_its_unet_on_its_own(tmp_path, monkeypatch):
    """tiny-sd@photo: the UNet sees photo only, the VAE every domain (as SD's VAE reconstructs any style);
    vae_domains='same' is the other build, in its own folder."""
    import fedapp.models.prior.tiny.train as train

    every, photo = bars(40), bars(20, seed=1)
    monkeypatch.setattr(train, "public_data", lambda dataset, size, seed, domains=None: photo if domains else every)
    seen = {}
    real_vae, real_unet = train.train_vae, train.train_tiny_prior
    monkeypatch.setattr(train, "train_vae", lambda x, *a: seen.__setitem__("vae", x) or real_vae(x, *a))
    monkeypatch.setattr(train, "train_tiny_prior", lambda z, *a: seen.__setitem__("unet", z) or real_unet(z, *a))
    kw = {"steps": 2, "cache_dir": tmp_path, "progress": False, "config": TEST_CONFIG, "domains": ("photo",),
          "vae": TEST_VAE_CONFIG}
    folder = build_tiny_prior("digit-styles", 32, **kw)
    assert torch.equal(seen["vae"], every[0]) and len(seen["unet"]) == 20  # UNet on photo's latents only
    meta = json.loads((folder / "prior_meta.json").read_text())
    assert meta["vae_domains"] == "all" and meta["vae_num_images"] == 40 and meta["domains"] == ["photo"]
    same = build_tiny_prior("digit-styles", 32, **kw, vae_domains="same")
    assert same != folder and torch.equal(seen["vae"], photo[0])
    assert json.loads((same / "prior_meta.json").read_text())["vae_num_images"] == 20
    with pytest.raises(ValueError, match="vae_domains='some': allowed all, same"):
        tiny_prior_path("digit-styles", 32, cache_dir=tmp_path, domains=("photo",), vae=TEST_VAE_CONFIG,
                        vae_domains="some")
