"""Image features: DIFT-style UNet decoder features of the prior, or a transformers vision backbone.

DIFT (Tang et al. 2023), as FedDifRC uses it: noise the (encoded) image to timestep t,
z_t = sqrt(abar_t) E(x) + sqrt(1 - abar_t) eps with a fixed seeded eps, run the UNet once
conditioned on a prompt (or a raw condition), read the outputs of chosen decoder up-blocks with
forward hooks, global-average-pool each and concatenate. Both extractors map x (B, 3, H, W) in
[-1, 1] to (B, F) through `__call__`, so Espresso's clustering can take either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass
class FeatureOutput:
    features: torch.Tensor  # (B, sum C_i): the pooled blocks concatenated
    blocks: list[torch.Tensor]  # per up-block (B, C_i), in `up_blocks` order (FedDifRC runs PCA per block)


class UNetFeatureExtractor:
    """DIFT features from the prior's decoder up-blocks `up_blocks` (Prior.decoder_features).

    up_blocks=None takes the decoder's last three up-blocks (SD-1.5: (1, 2, 3) = FedDifRC's layers 2-4;
    the 3-level tiny prior: (0, 1, 2)). The noise is one (1, C, h, w) draw from `seed` shared by all
    images, so a sample's features do not depend on its batch or position (the cache can be reused).
    """

    def __init__(self, prior, t: int = 261, up_blocks: tuple[int, ...] | None = None, prompt: str | None = None,
                 seed: int = 0, batch_size: int = 64):
        n = prior.num_up_blocks
        up_blocks = tuple(range(max(0, n - 3), n)) if up_blocks is None else tuple(up_blocks)
        if not up_blocks or any(not 0 <= i < n for i in up_blocks):
            raise ValueError(f"up_blocks={up_blocks}: this UNet has up-blocks 0..{n - 1}")
        if not 0 <= t < prior.num_train_timesteps:
            raise ValueError(f"t={t}: must be in [0, {prior.num_train_timesteps})")
        self.prior, self.t, self.up_blocks, self.prompt, self.seed = prior, t, up_blocks, prompt or "", seed
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(seed)
        self.noise = torch.randn(1, *prior.latent_shape, generator=g).to(prior.device, prior.dtype)
        self.dims = [prior.up_block_channels(i) for i in up_blocks]

    @property
    def dim(self) -> int:
        return sum(self.dims)

    def _cond(self, prompts: list[str] | str | None, cond: torch.Tensor | None) -> torch.Tensor:
        if cond is not None:
            return cond
        prompts = self.prompt if prompts is None else prompts
        return self.prior.encode_prompts([prompts] if isinstance(prompts, str) else list(prompts))

    @torch.no_grad()
    def maps(self, x: torch.Tensor, prompts: list[str] | str | None = None, cond: torch.Tensor | None = None):
        """Yield, per batch of `batch_size` images, the up-blocks' output maps [(b, C_i, h_i, w_i)] in
        `up_blocks` order. prompts: one per image or one for all (default: the extractor's prompt);
        cond: raw (B|1, L, D) conditions instead."""
        prior, cond = self.prior, self._cond(prompts, cond)
        for s in range(0, len(x), self.batch_size):
            xb = x[s:s + self.batch_size]
            cb = cond if cond.shape[0] == 1 else cond[s:s + self.batch_size]
            z0 = prior.encode_images(xb)
            z_t = prior.add_noise(z0, self.noise.expand_as(z0), self.t)
            t = torch.full((len(xb),), self.t, device=prior.device)
            yield [m.float() for m in prior.decoder_features(z_t, t, prior.condition(cb, len(xb)), self.up_blocks)]

    @torch.no_grad()
    def features(self, x: torch.Tensor, prompts: list[str] | str | None = None,
                 cond: torch.Tensor | None = None) -> FeatureOutput:
        """The maps of `maps`, each global-average-pooled: (B, sum C_i) and the per-block (B, C_i)."""
        outs: list[list[torch.Tensor]] = [[] for _ in self.up_blocks]
        for batch in self.maps(x, prompts, cond):
            for k, out in enumerate(batch):
                outs[k].append(F.adaptive_avg_pool2d(out, 1).flatten(1))
        blocks = [torch.cat(o) for o in outs]
        return FeatureOutput(torch.cat(blocks, dim=1), blocks)

    def __call__(self, x: torch.Tensor, prompts: list[str] | str | None = None,
                 cond: torch.Tensor | None = None) -> torch.Tensor:
        return self.features(x, prompts, cond).features


class VisionBackboneExtractor:
    """A transformers vision backbone (DINOv2, CLIP vision, ...) by hub id or folder -> pooled (B, F).

    Images go from [-1, 1] to [0, 1], are resized to the model's input size and normalised with its
    processor's mean/std (ImageNet's when the folder has no preprocessor config)."""

    IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

    def __init__(self, name_or_path: str, device: str | torch.device = "cpu", image_size: int | None = None,
                 batch_size: int = 64):
        import json
        from pathlib import Path

        from transformers import AutoModel

        self.name = str(name_or_path)
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.model = AutoModel.from_pretrained(self.name).to(self.device).eval().requires_grad_(False)
        cfg = getattr(self.model.config, "vision_config", self.model.config)
        mean, std, size = self.IMAGENET_MEAN, self.IMAGENET_STD, getattr(cfg, "image_size", 224)
        proc = Path(self.name) / "preprocessor_config.json"
        if proc.is_file():  # local folder: read it directly; hub ids fall back to the config's size
            p = json.loads(proc.read_text())
            mean, std = p.get("image_mean", mean), p.get("image_std", std)
            crop = p.get("crop_size") or p.get("size") or {}
            size = crop.get("height", crop.get("shortest_edge", size)) if isinstance(crop, dict) else crop
        self.image_size = int(image_size or size)
        self.mean = torch.tensor(mean).view(1, 3, 1, 1).to(self.device)
        self.std = torch.tensor(std).view(1, 3, 1, 1).to(self.device)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = []
        for s in range(0, len(x), self.batch_size):
            xb = (x[s:s + self.batch_size].to(self.device).float() + 1) / 2
            xb = F.interpolate(xb, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
            xb = (xb - self.mean) / self.std
            if hasattr(self.model, "get_image_features"):  # CLIPModel: the projected image embedding
                f = self.model.get_image_features(pixel_values=xb)
                f = f if torch.is_tensor(f) else f.pooler_output
            else:
                o = self.model(pixel_values=xb)
                f = o.pooler_output if getattr(o, "pooler_output", None) is not None else o.last_hidden_state.mean(1)
            out.append(f.float().flatten(1).cpu())
        return torch.cat(out)


def make_feature_extractor(spec: str, prior=None, **kwargs):
    """"unet" -> UNetFeatureExtractor(prior, **kwargs); anything else -> VisionBackboneExtractor(spec, **kwargs)."""
    if spec == "unet":
        if prior is None:
            raise ValueError("features='unet' needs a prior")
        return UNetFeatureExtractor(prior, **kwargs)
    return VisionBackboneExtractor(spec, **kwargs)
