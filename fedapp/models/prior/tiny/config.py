"""What a tiny prior is built from: architecture, schedule and training recipe, and the build's defaults.

Every field enters the cache key (cache.py), so a field's name or default changes which folder a
build lands in. docs/priors.md has the measurements behind the recipe's values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CODE_VERSION = "2"  # bump when training code changes what a cached prior contains
DEFAULT_STEPS = 500
DEFAULT_IMAGE_SIZE = 16  # pixels per side of a build when none is asked for
DEFAULT_DATASET = "digit-styles"  # what `tiny` alone names
LATENT_IMAGE_SIZE = 32  # tiny-sd: images of every dataset are resized (bilinear) to 32 px -> 8x8x4 latents


@dataclass(frozen=True)
class TinyPriorConfig:
    # architecture (DESIGN: 16x16, blocks (32,64,64), cross-attention below full resolution, 4 heads)
    block_out_channels: tuple[int, ...] = (32, 64, 64)
    layers_per_block: int = 1
    attention_heads: int = 4
    norm_num_groups: int = 8
    text_hidden: int = 64  # = cross_attention_dim
    text_layers: int = 2
    text_heads: int = 4
    max_tokens: int = 8  # L: "<bos> a photo of the digit three <eos>"
    # also pool the condition sequence into the time embedding (diffusers addition_embed_type="text",
    # as in DeepFloyd IF): a global path for the class besides cross-attention
    text_time_embedding: bool = True
    # noise schedule and parametrisation: v on cosine betas, because eps on linear betas learned no class
    beta_schedule: str = "squaredcos_cap_v2"  # or "linear" (beta_start..beta_end)
    beta_start: float = 1e-4
    beta_end: float = 0.02
    prediction_type: str = "v_prediction"  # or "epsilon"
    # training
    batch_size: int = 64
    lr: float = 2e-3
    text_lr_mult: float = 0.1  # at the UNet's rate the jointly trained text encoder collapses all prompts
    token_init_std: float = 1.0  # CLIP's 0.02 leaves the class token a whisper next to the positions
    weight_decay: float = 0.01
    warmup: float = 0.05  # share of steps with linear warm-up
    # after warm-up: "constant" (the EMA averages the end) or "cosine" to 0; the class emerges late in
    # training, and a decaying rate starves exactly that phase
    lr_schedule: str = "constant"
    ema_decay: float = 0.99
    p_uncond: float = 0.1  # share of empty prompts (classifier-free guidance)
    # t/T ~ sigmoid(N(0, 1)) (SD3's logit-normal): most steps at mid noise, where the class decides the shape
    t_sampling: str = "logit_normal"  # or "uniform"
    extra_words: tuple[str, ...] = field(default_factory=tuple)


# A much smaller architecture for tests (a forward pass costs milliseconds).
TEST_CONFIG = TinyPriorConfig(block_out_channels=(16, 32), attention_heads=2, text_hidden=32, text_layers=1,
                              text_heads=2, batch_size=16)


@dataclass(frozen=True)
class TinyVaeConfig:
    """tiny-sd's AutoencoderKL (SD's VAE at toy size): len(block_out_channels) down-blocks, each but the last
    halving the side (3 blocks: 32 px -> 8x8), `latent_channels` = 4 as SD's; trained on MSE + kl_weight * KL
    (mean per element; SD adds LPIPS and a GAN, which a 32 px digit does not need)."""
    # (16, 32, 32) at batch 32: 0.2 s a step on one busy core, test MSE 0.0033 after 800 steps on mnist-5k's
    # 750 public digits; (32, 64, 64) at batch 64 cost 6.5x a step (docs/priors.md, tiny-sd)
    block_out_channels: tuple[int, ...] = (16, 32, 32)
    latent_channels: int = 4
    layers_per_block: int = 1
    norm_num_groups: int = 8
    batch_size: int = 32
    lr: float = 2e-3
    steps: int = 800
    kl_weight: float = 1e-4


# tiny-sd's UNet on 8x8x4 latents: two levels (8, 4), cross-attention at 4x4; otherwise the tiny recipe
LATENT_CONFIG = TinyPriorConfig(block_out_channels=(64, 128))
TEST_VAE_CONFIG = TinyVaeConfig(block_out_channels=(8, 16, 16), norm_num_groups=4, batch_size=16, steps=4)
