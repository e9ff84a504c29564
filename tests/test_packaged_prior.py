"""Tiny priors packaged with fedapp: a float16 copy of one build, checked by sha256, installed into the
cache instead of building (the default experiment's prior on a fresh machine); a copy that fails its hash
is refused and the prior is built as before."""

import json
import logging
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file

from fedapp.config import all_defaults, parse_run_config
from fedapp.models.prior import ensure_prior_built, load_prior, resolve_prior, tiny_prior_missing
from fedapp.models.prior.samplers import SamplerSettings
from fedapp.models.prior.tiny import TEST_CONFIG, build_tiny_prior, packaged
from fedapp.models.prior.tiny.config import TEST_VAE_CONFIG

from test_tiny_sd import bars


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    folder = build_tiny_prior("digits", 32, steps=4, cache_dir=cache, progress=False, config=TEST_CONFIG,
                              data=bars(), vae=TEST_VAE_CONFIG)
    return folder


@pytest.fixture
def packaged_here(built, tmp_path, monkeypatch):
    """The build packaged into a package root of the test's own (the real one is left alone)."""
    root = tmp_path / "packaged"
    monkeypatch.setattr(packaged, "PACKAGED_ROOT", root)
    return packaged.package(built), root


def _weights(folder):
    return {p.relative_to(folder).as_posix(): load_file(p) for p in sorted(folder.rglob("*.safetensors"))}


def test_a_packaged_copy_holds_float16_weights_and_the_hash_of_every_file(built, packaged_here):
    copy, root = packaged_here
    assert copy == root / built.name
    manifest = json.loads((copy / packaged.MANIFEST).read_text())
    files = {p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file()} - {packaged.MANIFEST}
    assert set(manifest) == files and "prior_meta.json" in files and "samples.png" not in files
    original, half = _weights(built), _weights(copy)
    assert set(half) == {"unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                         "text_encoder/model.safetensors"} == set(original)
    for name, tensors in half.items():
        for key, t in tensors.items():
            if original[name][key].is_floating_point():
                assert t.dtype == torch.float16 and torch.equal(t, original[name][key].half())
    # half the bytes of the build's weights
    assert packaged.packaged_bytes(root) < 0.6 * sum(p.stat().st_size for p in built.rglob("*.safetensors")) + 2e5
    assert packaged.verify(copy) is None


def test_installing_a_packaged_copy_fills_the_cache_with_a_prior_that_samples_like_the_build(built, packaged_here,
                                                                                           tmp_path):
    copy, root = packaged_here
    target = tmp_path / "cache" / built.name
    assert packaged.install_packaged(target, root)
    assert packaged.verify(copy) is None  # the copy is left as it was
    a, b = load_prior(built), load_prior(target)
    assert all(p.dtype == torch.float32 for p in b.unet.parameters())  # float16 files, float32 modules
    noise = torch.randn(3, *a.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = a.encode_prompts(["a photo of the digit three"] * 3)
    x_a = a.sample(noise, cond, SamplerSettings(num_steps=5, guidance=2.0)).images
    x_b = b.sample(noise, b.encode_prompts(["a photo of the digit three"] * 3),
                   SamplerSettings(num_steps=5, guidance=2.0)).images
    assert x_a.shape == x_b.shape == (3, 3, 32, 32)
    assert float((x_a - x_b).abs().max()) < 0.05 and not torch.equal(x_a, x_b)  # float16 rounding, no more


@pytest.mark.parametrize("damage", ["byte", "missing", "extra"])
def test_a_damaged_copy_is_refused_in_one_line_and_nothing_is_installed(built, packaged_here, tmp_path, damage,
                                                                        caplog):
    copy, root = packaged_here
    weights = copy / "unet" / "diffusion_pytorch_model.safetensors"
    if damage == "byte":
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1
        weights.write_bytes(bytes(data))
    elif damage == "missing":
        weights.unlink()
    else:
        (copy / "unet" / "extra.bin").write_bytes(b"x")
    target = tmp_path / "cache" / built.name
    with caplog.at_level(logging.WARNING, logger="fedapp"):
        assert not packaged.install_packaged(target, root)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "refused" in lines[0] and "building it instead" in lines[0]
    assert "unet/" in lines[0] and "\n" not in lines[0]
    assert not target.exists()


def test_load_and_build_paths_install_a_packaged_build_before_building(built, packaged_here, tmp_path, monkeypatch):
    _, root = packaged_here
    cache = tmp_path / "cache2"
    target = cache / built.name
    src = resolve_prior("tiny", "digits", cache)
    monkeypatch.setattr(packaged, "PACKAGED_ROOT", tmp_path / "none")
    assert tiny_prior_missing("tiny", "digits", cache)
    # package the build under the name the spec resolves to: the spec's folder comes from the package, not a build
    shutil.copytree(root / built.name, root / src.folder.name)
    monkeypatch.setattr(packaged, "PACKAGED_ROOT", root)
    assert not tiny_prior_missing("tiny", "digits", cache)
    calls = []
    monkeypatch.setattr("fedapp.models.prior.tiny.build_tiny_prior", lambda *a, **k: calls.append(a))
    assert ensure_prior_built("tiny", "digits", cache) is False and calls == []  # installed, not built
    assert (src.folder / "prior_meta.json").is_file()
    shutil.rmtree(src.folder)
    assert load_prior("tiny", dataset="digits", cache_dir=cache).latent_shape == (4, 8, 8)  # a client's path too
    assert not target.exists()


def test_under_flwr_run_the_weights_are_found_where_pip_installed_fedapp(built, packaged_here, tmp_path,
                                                                         monkeypatch, caplog):
    """`flwr run` imports fedapp from its app bundle (FAB), which Flower fills with text files only: the
    packaged copy there has its manifest and configs but no weights. The lookup then takes the copy at the
    same path under another sys.path entry (site-packages, or an editable install's source tree)."""
    from flwr.cli.build import get_filtered_fab_paths

    copy, _ = packaged_here
    files = {p.relative_to(copy).as_posix(): p for p in copy.rglob("*") if p.is_file()}
    with warnings.catch_warnings():  # Flower's own use of a deprecated pathspec pattern class
        warnings.simplefilter("ignore", DeprecationWarning)
        in_fab = get_filtered_fab_paths(files, {"tool": {"flwr": {"app": {}}}})
    assert "MANIFEST.json" in in_fab and not any(f.endswith(".safetensors") for f in in_fab)
    bundle = tmp_path / "fab" / built.name
    for rel in in_fab:
        (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(files[rel], bundle / rel)
    site = tmp_path / "site"
    shutil.copytree(copy, site / "fedapp" / "models" / "prior" / "tiny" / "packaged" / built.name)
    monkeypatch.setattr(packaged, "PACKAGED_ROOT", tmp_path / "fab")  # the module's own folder: the bundle's
    target = tmp_path / "cache" / built.name
    with caplog.at_level(logging.WARNING, logger="fedapp"):
        assert not packaged.install_packaged(target)  # the bundle alone: refused in one line
    assert "refused" in caplog.text and ".safetensors" in caplog.text and not target.exists()
    monkeypatch.syspath_prepend(str(site))
    assert packaged.packaged_copy(target) == (site / "fedapp/models/prior/tiny/packaged" / built.name).resolve()
    assert packaged.install_packaged(target)
    assert _weights(target).keys() == _weights(copy).keys()


def test_the_default_experiments_prior_is_packaged_with_fedapp_and_checks():
    """The default run config's prior is packaged under the very cache name that config resolves to, its hashes
    hold and all packaged priors fit the package's 10 MB: a recipe change that forgets to re-package
    (`python -m fedapp.models.prior.tiny --dataset <default dataset> [--latent] --package`) fails here."""
    cfg = parse_run_config(all_defaults())
    src = resolve_prior(cfg.prior, cfg.dataset)
    copy = packaged.packaged_copy(src.folder)
    assert copy is not None, f"no packaged copy of {src.folder.name}"
    assert packaged.verify(copy) is None
    assert packaged.packaged_bytes() <= 10_000_000
    assert sorted(p.name for p in packaged.PACKAGED_ROOT.iterdir()) == [src.folder.name]  # no stale copies
    unet = load_file(next((copy / "unet").glob("*.safetensors")))
    assert all(t.dtype == torch.float16 for t in unet.values() if t.is_floating_point())
