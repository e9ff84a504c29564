"""The component configs (unet/, vae/, text_encoder/, scheduler/ config files) of the Stable Diffusion
pipelines the papers use, shipped as data: what the planner reads for a hub id that is neither a local
folder nor in the local Hugging Face cache (this machine may never reach the hub). KNOWN maps hub ids to
them; any other hub id plans as Stable Diffusion 1.5 (the report says so). Any other architecture plans
from a folder holding its config files (no weights needed): `prior=<folder>`."""

from __future__ import annotations

from typing import Any

UNET = {
    "_class_name": "UNet2DConditionModel", "act_fn": "silu", "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280], "center_input_sample": False, "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2,
    "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4, "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}
VAE = {
    "_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4, "in_channels": 3, "latent_channels": 4, "layers_per_block": 2,
    "norm_num_groups": 32, "out_channels": 3, "sample_size": 512, "up_block_types": ["UpDecoderBlock2D"] * 4,
}
TEXT_ENCODER = {  # CLIP ViT-L/14's text tower
    "architectures": ["CLIPTextModel"], "hidden_act": "quick_gelu", "hidden_size": 768, "intermediate_size": 3072,
    "max_position_embeddings": 77, "num_attention_heads": 12, "num_hidden_layers": 12, "projection_dim": 768,
    "vocab_size": 49408, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
}
SCHEDULER = {
    "_class_name": "PNDMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
    "num_train_timesteps": 1000, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
    "clip_sample": False,
}


# Stable Diffusion 2.1 (stabilityai/stable-diffusion-2-1: 768 px, v-prediction; -base: 512 px, epsilon), with
# OpenCLIP ViT-H/14's text tower (1024 wide, 23 layers) and SD's VAE
UNET_21 = {**UNET, "attention_head_dim": [5, 10, 20, 20], "cross_attention_dim": 1024, "sample_size": 96,
           "use_linear_projection": True, "upcast_attention": True}
TEXT_ENCODER_21 = {**TEXT_ENCODER, "hidden_act": "gelu", "hidden_size": 1024, "intermediate_size": 4096,
                   "num_attention_heads": 16, "num_hidden_layers": 23, "projection_dim": 512}
SCHEDULER_21 = {**SCHEDULER, "_class_name": "DDIMScheduler", "prediction_type": "v_prediction"}

SD15: dict[str, Any]  # a pipeline: component -> its config, and its name
SD21: dict[str, Any]
SD21_BASE: dict[str, Any]
KNOWN: dict[str, dict[str, Any]]
SD15 = {"unet": UNET, "text": TEXT_ENCODER, "vae": VAE, "scheduler": SCHEDULER, "name": "Stable Diffusion 1.5"}
SD21 = {"unet": UNET_21, "text": TEXT_ENCODER_21, "vae": {**VAE, "sample_size": 768}, "scheduler": SCHEDULER_21,
        "name": "Stable Diffusion 2.1"}
SD21_BASE = {**SD21, "unet": {**UNET_21, "sample_size": 64, "upcast_attention": False}, "vae": VAE,
             "scheduler": {**SCHEDULER_21, "prediction_type": "epsilon"}, "name": "Stable Diffusion 2.1 base"}
KNOWN = {"runwayml/stable-diffusion-v1-5": SD15, "stable-diffusion-v1-5/stable-diffusion-v1-5": SD15,
         "CompVis/stable-diffusion-v1-4": SD15, "stabilityai/stable-diffusion-2-1": SD21,
         "stabilityai/stable-diffusion-2-1-base": SD21_BASE}
