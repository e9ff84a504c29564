"""Feature extractors: DIFT-style UNet features of the prior and a transformers vision backbone."""

import pytest
import torch

from fedapp.models.features import UNetFeatureExtractor, VisionBackboneExtractor, make_feature_extractor
from fedapp.models.prior.tiny import TinyPriorConfig, random_tiny_prior

PROMPT = "a photo of the digit three"


@pytest.fixture(scope="module")
def prior():
    # 3 levels like the real tiny prior, narrow channels for speed
    cfg = TinyPriorConfig(block_out_channels=(16, 32, 32), attention_heads=2, text_hidden=32, text_layers=1,
                          text_heads=2)
    return random_tiny_prior(cfg)


def test_shapes_and_block_split(prior):
    fx = UNetFeatureExtractor(prior, t=261, prompt=PROMPT)
    assert fx.up_blocks == (0, 1, 2) and fx.dims == [32, 32, 16] and fx.dim == 80
    x = torch.rand(5, 3, 16, 16) * 2 - 1
    out = fx.features(x)
    assert out.features.shape == (5, 80) and [b.shape for b in out.blocks] == [(5, 32), (5, 32), (5, 16)]
    assert torch.equal(out.features, torch.cat(out.blocks, 1)) and torch.isfinite(out.features).all()
    assert torch.equal(fx(x), out.features)
    one = UNetFeatureExtractor(prior, up_blocks=(2,))
    assert one(x).shape == (5, 16)
    with pytest.raises(ValueError, match="up_blocks"):
        UNetFeatureExtractor(prior, up_blocks=(1, 2, 3))


def test_deterministic_and_batch_independent(prior):
    x = torch.rand(6, 3, 16, 16) * 2 - 1
    a = UNetFeatureExtractor(prior, seed=3, batch_size=4)(x, PROMPT)
    b = UNetFeatureExtractor(prior, seed=3, batch_size=6)(x, PROMPT)
    assert torch.allclose(a, b, atol=1e-5)  # same seed, other batching -> same features
    assert torch.allclose(a[2:3], UNetFeatureExtractor(prior, seed=3)(x[2:3], PROMPT), atol=1e-5)
    c = UNetFeatureExtractor(prior, seed=4)(x, PROMPT)
    assert not torch.allclose(a, c)


def test_prompts_and_raw_condition(prior):
    fx = UNetFeatureExtractor(prior)
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    prompts = [PROMPT, "a photo of the digit one"]
    by_prompt = fx(x, prompts)
    by_cond = fx(x, cond=prior.encode_prompts(prompts))
    assert torch.allclose(by_prompt, by_cond, atol=1e-6)
    assert not torch.allclose(fx(x, PROMPT)[1], by_prompt[1])  # the condition matters


def test_vision_backbone_on_tiny_local_dinov2(tmp_path):
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                             image_size=28, patch_size=7)).save_pretrained(tmp_path / "dino")
    fx = make_feature_extractor(str(tmp_path / "dino"))
    assert isinstance(fx, VisionBackboneExtractor) and fx.image_size == 28
    x = torch.rand(3, 3, 16, 16) * 2 - 1
    f = fx(x)
    assert f.shape == (3, 32) and torch.isfinite(f).all()
    assert torch.equal(f, fx(x))


def test_make_feature_extractor_unet(prior):
    fx = make_feature_extractor("unet", prior, t=100)
    assert isinstance(fx, UNetFeatureExtractor) and fx.t == 100
    with pytest.raises(ValueError):
        make_feature_extractor("unet", None)
