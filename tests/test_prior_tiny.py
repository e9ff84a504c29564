"""The built-in tiny prior: build -> cache -> load round trip, weight shipping, load_prior's errors.

Uses the small TEST_CONFIG and a few training steps on synthetic images (never the cached prior)."""

import json

import pytest
import torch

from fedapp.models.prior import load_prior, prior_from_records, prior_to_records
from fedapp.models.prior.samplers import SamplerSettings
from fedapp.models.prior.tiny import TEST_CONFIG, build_tiny_prior, build_tokenizer, tiny_prior_path
from fedapp.models.text import class_prompts

NAMES = ["zero", "one", "two"]


def synthetic(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.rand(n, 3, 16, 16, generator=g) * 0.2 - 1
    x[:, y % 3, 4:12, 4:12] = 0.8  # class c lights up channel c: learnable, but it does not matter here
    return x, y, NAMES


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    folder = build_tiny_prior("digits", steps=6, cache_dir=cache, progress=False, config=TEST_CONFIG,
                              data=synthetic())
    return cache, folder


def test_build_writes_sd_layout_and_meta(built):
    cache, folder = built
    assert folder.parent == cache and folder.name.startswith("digits-")
    for sub in ("unet", "text_encoder", "tokenizer", "scheduler"):
        assert (folder / sub).is_dir()
    assert not (folder / "vae").exists()
    meta = json.loads((folder / "prior_meta.json").read_text())
    assert meta["steps"] == 6 and meta["prompts"] == class_prompts("digits", NAMES)
    assert meta["seconds"] > 0 and meta["final_loss"] > 0
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp folder left behind


def test_build_is_cached_and_keyed(built):
    cache, folder = built
    mtime = (folder / "prior_meta.json").stat().st_mtime
    again = build_tiny_prior("digits", steps=6, cache_dir=cache, progress=False, config=TEST_CONFIG, data=synthetic())
    assert again == folder and (folder / "prior_meta.json").stat().st_mtime == mtime
    assert tiny_prior_path("digits", steps=7, cache_dir=cache, config=TEST_CONFIG) != folder
    assert tiny_prior_path("digits", seed=1, cache_dir=cache, config=TEST_CONFIG) != tiny_prior_path(
        "digits", seed=0, cache_dir=cache, config=TEST_CONFIG)


def test_load_round_trip(built):
    _, folder = built
    prior = load_prior(folder)
    assert prior.vae is None and prior.latent_shape == (3, 16, 16)
    assert prior.cond_shape == (TEST_CONFIG.max_tokens, TEST_CONFIG.text_hidden)
    assert prior.clip_sample == 1.0  # pixel space clips x0 to [-1, 1]
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    assert torch.equal(prior.encode_images(x), x)  # pixel space: identity
    out = prior.sample(2, class_prompts("digits", NAMES)[:2], SamplerSettings(num_steps=3, guidance=2.0),
                       generator=torch.Generator().manual_seed(0))
    assert out.images.shape == (2, 3, 16, 16) and torch.isfinite(out.images).all()
    # saving the loaded prior again gives a folder that loads to the same weights
    again = load_prior(prior.save_pretrained(folder.parent / "resaved"))
    for a, b in zip(prior.unet.state_dict().values(), again.unet.state_dict().values()):
        assert torch.equal(a, b)


def test_tokenizer_round_trip(tmp_path):
    from transformers import AutoTokenizer

    tok = build_tokenizer(["a", "photo", "of", "the", "digit", "three"], 8)
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    kw = dict(padding="max_length", max_length=8, truncation=True)
    for text in ["a photo of the digit three", "", "A PHOTO of a zebra"]:
        assert tok(text, **kw).input_ids == back(text, **kw).input_ids
    ids = back("a photo of the digit three", **kw).input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id and len(ids) == 8
    assert back("zebra", **kw).input_ids[1] == tok.unk_token_id


def test_shipping_as_records_round_trips_and_refuses_bad_paths(built, tmp_path):
    from flwr.app import ConfigRecord

    _, folder = built
    (folder / "samples.png").write_bytes(b"png")  # what `python -m fedapp.models.prior.tiny` leaves beside it
    weights, files = prior_to_records(folder)
    (folder / "samples.png").unlink()
    assert all("::" in k and k.split("::")[0].endswith(".safetensors") for k in weights.keys())
    assert "samples.png" not in files.keys()
    assert "unet/config.json" in files.keys() and "model_index.json" in files.keys()
    shipped = prior_from_records(weights, files, cache_dir=tmp_path)
    assert shipped.name.startswith("shipped-") and prior_from_records(weights, files, cache_dir=tmp_path) == shipped
    a, b = load_prior(folder), load_prior(shipped)
    for (ka, va), (kb, vb) in zip(a.unet.state_dict().items(), b.unet.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    for va, vb in zip(a.text_encoder.state_dict().values(), b.text_encoder.state_dict().values()):
        assert torch.equal(va, vb)
    for bad in ("../escape.json", "/etc/evil.json", "unet/run.py"):
        with pytest.raises(ValueError, match="refusing path"):
            prior_from_records(weights, ConfigRecord({**{k: files[k] for k in files.keys()}, bad: b"x"}),
                               cache_dir=tmp_path / "other")
    (folder / "unet" / "extra.bin").write_bytes(b"x")  # a pickle-format weight: refused, not silently left out
    try:
        with pytest.raises(ValueError, match="cannot ship unet/extra.bin"):
            prior_to_records(folder)
    finally:
        (folder / "unet" / "extra.bin").unlink()


def test_load_prior_errors(tmp_path):
    with pytest.raises(ValueError, match=r"prior='/no/such/folder'.*allowed"):
        load_prior("/no/such/folder")
    with pytest.raises(ValueError, match=r"prior='not-a-prior'"):
        load_prior("not-a-prior")
    (tmp_path / "half").mkdir()
    with pytest.raises(ValueError, match=r"lacks unet/"):
        load_prior(tmp_path / "half")
    with pytest.raises(ValueError, match=r"prior='tiny:digits'.*python -m fedapp.models.prior.tiny"):
        load_prior("tiny:digits", cache_dir=tmp_path)


def test_evaluate_reports_accuracy_and_grid(built):
    from fedapp.prior_evaluation import evaluate_tiny_prior

    _, folder = built
    out = evaluate_tiny_prior(folder, "digits", per_class=2, guidances=(1.0, 3.0), num_steps=3, data=synthetic(),
                              test=synthetic(seed=1)[:2], classifier_epochs=1)
    assert 0 <= out["sample_accuracy"] <= 1 and out["sample_guidance"] in (1.0, 3.0)
    assert set(out["accuracy_by_guidance"]) == {"1.0", "3.0"} and out["zigzag"]["unet_evals"] > 0
    assert (folder / "samples.png").is_file()
    assert out["reader_accuracy"] == {"label": pytest.approx(out["reference_test_accuracy"], abs=1e-4)}


# ---- a prior trained on some domains only (tiny@<domain>) ---------------------------------------------
def test_a_domain_prior_has_its_own_cache_folder_and_the_full_one_keeps_its_name():
    from fedapp.models.prior.spec import resolve_prior

    full, photo = resolve_prior("tiny", "digit-styles"), resolve_prior("tiny:digit-styles@photo")
    assert full.domains is None and photo.domains == ("photo",) and photo.dataset == "digit-styles"
    assert full.folder.name == "digit-styles-7645dc2a5c7f"  # the key of an all-domain prior did not change
    assert photo.folder.name.startswith("digit-styles@photo-") and photo.folder.parent == full.folder.parent
    assert (resolve_prior("tiny@sketch+photo", "digit-styles").folder
            == resolve_prior("tiny@photo+sketch", "digit-styles").folder)


@pytest.mark.parametrize("spec,dataset,why", [
    ("tiny@fresco", "digit-styles", "prior='tiny@fresco': domains 'fresco': allowed one or more of photo, sketch, "
                                    "clipart, quickdraw"),
    ("tiny@", "digit-styles", "prior='tiny@': domains '': allowed one or more of"),
    ("tiny@photo", "digits", "prior='tiny@photo': domains 'photo': dataset 'digits' has no domains")])
def test_unknown_prior_domains_are_refused_naming_the_allowed_ones(spec, dataset, why):
    from fedapp.models.prior.spec import resolve_prior

    with pytest.raises(ValueError, match=why):
        resolve_prior(spec, dataset)


def test_a_domain_prior_trains_on_those_domains_public_images_only():
    import feddata
    from fedapp.models.prior.tiny.train import public_data

    pub = feddata.load_server_data("digit-styles", "iid", {}, 0, num_partitions=4, image_size=16).public
    x, y, _ = public_data("digit-styles", 16, 0, domains=("photo", "quickdraw"))
    keep = (pub.attrs["domain"] == 0) | (pub.attrs["domain"] == 3)
    assert 0 < len(x) < len(pub.x) and torch.equal(x, pub.x[keep]) and torch.equal(y, pub.y[keep])


def test_a_domain_prior_builds_into_its_own_folder_and_says_its_domains(tmp_path):
    folder = build_tiny_prior("digit-styles", steps=2, cache_dir=tmp_path, progress=False, config=TEST_CONFIG,
                              domains=("quickdraw", "photo"))
    assert folder.name.startswith("digit-styles@photo+quickdraw-")
    assert json.loads((folder / "prior_meta.json").read_text())["domains"] == ["photo", "quickdraw"]
    assert folder == tiny_prior_path("digit-styles", cache_dir=tmp_path, config=TEST_CONFIG, steps=2,
                                     domains=("photo", "quickdraw"))


def test_a_shipped_prior_is_named_by_its_digest_and_a_damaged_copy_is_not_held(built, tmp_path):
    from fedapp.models.prior import cached_shipped, records_digest

    _, folder = built
    weights, files = prior_to_records(folder)
    digest = records_digest(weights, files)
    assert cached_shipped(digest, cache_dir=tmp_path) is None  # not received yet
    with pytest.raises(ValueError, match="not the announced"):
        prior_from_records(weights, files, cache_dir=tmp_path, expect="0" * 64)
    shipped = prior_from_records(weights, files, cache_dir=tmp_path, expect=digest)
    assert cached_shipped(digest, cache_dir=tmp_path) == shipped
    assert records_digest(*prior_to_records(shipped)) == digest  # the folder hashes back to its name
    other = tmp_path / "other"  # a copy whose bytes changed is not the prior its name says (fresh process view)
    copy = prior_from_records(weights, files, cache_dir=other)
    cfg = copy / "unet" / "config.json"
    cfg.write_bytes(cfg.read_bytes().replace(b"{", b"{ ", 1))
    assert cached_shipped(digest, cache_dir=other) is None
    assert prior_from_records(weights, files, cache_dir=other, expect=digest) == copy  # re-received: whole again
    assert cached_shipped(digest, cache_dir=other) == copy


def test_a_frozen_prior_is_loaded_once_per_folder_not_once_per_spec(built, tmp_path, monkeypatch):
    import shutil

    from fedapp.models.prior import load_frozen_prior
    from fedapp.models.prior.tiny import tiny_prior_path

    _, folder = built
    loaded = {}
    for name in ("a", "b"):  # the same spec, `tiny`, under two cache roots: two folders, two priors
        monkeypatch.setenv("FEDAPP_CACHE", str(tmp_path / name))
        shutil.copytree(folder, tiny_prior_path("digits"))
        loaded[name] = load_frozen_prior("tiny", "digits", "cpu")
        assert load_frozen_prior("tiny", "digits", "cpu") is loaded[name]  # kept for the next message
    assert loaded["a"] is not loaded["b"]
