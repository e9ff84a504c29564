"""Pieces shared by the DDPM (PFDM) and flow-matching (DCFM) networks."""

from __future__ import annotations

import math

import torch
from torch import nn


def _null_indexed(y: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """y (B, k) or (B,) with y[:, i] in [0, sizes[i]) or -1 (null) -> (B, k) with null at index sizes[i]."""
    if y.ndim == 1:
        y = y[:, None]
    if y.shape[1] != len(sizes):
        raise ValueError(f"labels of shape {tuple(y.shape)}: expected (B, {len(sizes)})")
    cols = []
    for i, size in enumerate(sizes):
        yi = y[:, i].long()
        if ((yi < -1) | (yi >= size)).any():
            raise ValueError(f"attribute {i}: labels must be in [-1, {size})")
        cols.append(torch.where(yi < 0, torch.full_like(yi, size), yi))
    return torch.stack(cols, 1)


class AttributeEmbedding(nn.Module):
    """Sum of one learned table per attribute, each with an extra null index for "absent/masked".

    y: (B, k) int64, y[:, i] in [0, sizes[i]) or -1 (null). Output (B, dim), added to the time
    embedding through UNet2DModel's class-embedding path (emb = t_emb + class_emb)."""

    def __init__(self, sizes: list[int] | tuple[int, ...], dim: int):
        super().__init__()
        self.sizes = [int(s) for s in sizes]
        self.tables = nn.ModuleList(nn.Embedding(s + 1, dim) for s in self.sizes)  # index s = null

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        idx = _null_indexed(y, self.sizes)
        return sum(table(idx[:, i]) for i, table in enumerate(self.tables))


class JointEmbedding(nn.Module):
    """One learned vector per label tuple (each attribute's value or null): prod(sizes[i] + 1) rows, no vector
    shared between tuples. The ablation of AttributeEmbedding: a pair no client holds keeps its random init."""

    def __init__(self, sizes: list[int] | tuple[int, ...], dim: int):
        super().__init__()
        self.sizes = [int(s) for s in sizes]
        self.table = nn.Embedding(math.prod(s + 1 for s in self.sizes), dim)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        idx = _null_indexed(y, self.sizes)
        flat = torch.zeros_like(idx[:, 0])
        for i, size in enumerate(self.sizes):  # mixed radix: attribute i's digit has base sizes[i] + 1
            flat = flat * (size + 1) + idx[:, i]
        return self.table(flat)


LABEL_EMBEDDINGS = {"sum": AttributeEmbedding, "joint": JointEmbedding}


def small_unet2d(image_size: int, channels: int = 3, block_out_channels: tuple[int, ...] = (32, 64, 64),
                 attention: bool = True, attribute_sizes: list[int] | None = None, layers_per_block: int = 1,
                 label_embedding: str = "sum"):
    """A diffusers UNet2DModel sized for 16x16 CPU work: self-attention only at the lowest resolution
    (full-resolution attention is most of a CPU step); an optional label embedding as class embedding
    (LABEL_EMBEDDINGS[label_embedding]: AttributeEmbedding, or JointEmbedding for "joint")."""
    from diffusers import UNet2DModel

    n = len(block_out_channels)
    last = ("AttnDownBlock2D",) if attention else ("DownBlock2D",)
    down = ("DownBlock2D",) * (n - 1) + last
    up = (("AttnUpBlock2D",) if attention else ("UpBlock2D",)) + ("UpBlock2D",) * (n - 1)
    unet = UNet2DModel(sample_size=image_size, in_channels=channels, out_channels=channels,
                       block_out_channels=tuple(block_out_channels), down_block_types=down, up_block_types=up,
                       layers_per_block=layers_per_block, norm_num_groups=8, attention_head_dim=8)
    if attribute_sizes:
        # UNet2DModel adds class_embedding(class_labels) to the time embedding when it is set
        embedding = LABEL_EMBEDDINGS[label_embedding]
        unet.class_embedding = embedding(attribute_sizes, unet.time_embedding.linear_2.out_features)
    return unet
