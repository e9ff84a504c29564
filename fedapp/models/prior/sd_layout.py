"""A Stable-Diffusion-1.5-layout pipeline at toy size with random weights: what the tests and the GPU
check load through the same `from_pretrained` code that loads runwayml/stable-diffusion-v1-5.

VAE (AutoencoderKL, `levels` down-blocks: a 2**(levels-1) downsampling, 4 latent channels), CLIP text
encoder with a small BPE vocabulary, UNet2DConditionModel with cross-attention, and SD-1.5's own
scheduler config (PNDM, scaled_linear betas, steps_offset 1). Timing does not depend on the weights;
samples are noise.
"""

from __future__ import annotations

import json
import string
from pathlib import Path


def random_sd_pipeline(workdir: str | Path, image_size: int = 32, levels: int = 2, width: int = 16, seed: int = 0):
    """A StableDiffusionPipeline whose VAE maps image_size px to image_size / 2**(levels-1) latents."""
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    letters = list(string.ascii_lowercase)
    vocab = ["<|startoftext|>", "<|endoftext|>"] + letters + [c + "</w>" for c in letters] + ["th", "the</w>"]
    files = Path(workdir) / "tokenizer_files"
    files.mkdir(parents=True, exist_ok=True)
    (files / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (files / "merges.txt").write_text("#version: 0.2\nt h\nth e</w>\n")
    tokenizer = CLIPTokenizer.from_pretrained(files, model_max_length=77)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * levels,
                        up_block_types=("UpDecoderBlock2D",) * levels,
                        block_out_channels=tuple(8 * 2**i for i in range(levels)),
                        latent_channels=4, layers_per_block=1, norm_num_groups=4, sample_size=image_size)
    unet = UNet2DConditionModel(
        sample_size=image_size // 2 ** (levels - 1), in_channels=4, out_channels=4,
        block_out_channels=(width, 2 * width), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=2, norm_num_groups=8)
    scheduler = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              num_train_timesteps=1000, set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1)
    return StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
