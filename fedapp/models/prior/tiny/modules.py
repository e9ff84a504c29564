"""The tiny prior's untrained components, built from a TinyPriorConfig, and the random-weights test prior."""

from __future__ import annotations

import torch

from ...text import class_prompts, prompt_words
from ..pipeline import Prior
from .config import TinyPriorConfig

SPECIALS = ("<pad>", "<unk>", "<|startoftext|>", "<|endoftext|>")  # ids 0..3


def build_tokenizer(words: list[str], max_length: int):
    """Word-level tokenizer (tokenizers: WordLevel + Whitespace, lower-cased) wrapped as a
    transformers fast tokenizer; pads/truncates to max_length with <bos> ... <eos> like CLIP."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(list(SPECIALS) + [w for w in words if w not in SPECIALS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", 2), ("<|endoftext|>", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<pad>", unk_token="<unk>", model_max_length=max_length)


def build_modules(config: TinyPriorConfig, words: list[str], image_size: int = 16, channels: int = 3):
    """Untrained (tokenizer, text_encoder, unet, scheduler) from configs."""
    from diffusers import DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = build_tokenizer(words, config.max_tokens)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=config.text_hidden, intermediate_size=4 * config.text_hidden,
        num_hidden_layers=config.text_layers, num_attention_heads=config.text_heads,
        max_position_embeddings=config.max_tokens, projection_dim=config.text_hidden,
        pad_token_id=0, bos_token_id=2, eos_token_id=3))
    n = len(config.block_out_channels)
    # cross-attention on every level but the full-resolution one (full-res attention costs 2-3x on CPU)
    down = ("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (n - 1)
    up = ("CrossAttnUpBlock2D",) * (n - 1) + ("UpBlock2D",)
    unet = UNet2DConditionModel(
        sample_size=image_size, in_channels=channels, out_channels=channels,
        block_out_channels=tuple(config.block_out_channels), down_block_types=down, up_block_types=up,
        layers_per_block=config.layers_per_block, cross_attention_dim=config.text_hidden,
        attention_head_dim=config.attention_heads,  # diffusers' legacy name: this is the number of heads
        norm_num_groups=config.norm_num_groups,
        **(dict(addition_embed_type="text", addition_embed_type_num_heads=config.text_heads)
           if config.text_time_embedding else {}))
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_start=config.beta_start, beta_end=config.beta_end,
                              beta_schedule=config.beta_schedule, clip_sample=True, set_alpha_to_one=True,
                              steps_offset=0, prediction_type=config.prediction_type, timestep_spacing="leading")
    with torch.no_grad():
        text_encoder.get_input_embeddings().weight.normal_(0.0, config.token_init_std)
    return tokenizer, text_encoder, unet, scheduler


def random_tiny_prior(config: TinyPriorConfig | None = None, image_size: int = 16, dataset: str = "digits",
                      class_names: list[str] | None = None, seed: int = 0, device: str = "cpu",
                      clip_sample: bool = True) -> Prior:
    """A Prior with untrained (seeded random) weights: for tests and timing benchmarks only."""
    class_names = class_names or ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    torch.manual_seed(seed)
    words = prompt_words(class_prompts(dataset, class_names))
    tokenizer, text_encoder, unet, scheduler = build_modules(config or TinyPriorConfig(), words, image_size)
    scheduler.register_to_config(clip_sample=clip_sample)
    return Prior(tokenizer, text_encoder, unet, scheduler, device=device, source="random")
