"""Image grids for docs and run folders (PIL only: no plotting stack needed)."""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from PIL import Image

from .types import Split


def grid_array(x: torch.Tensor, nrow: int = 8, pad: int = 1, min_cell: int = 32) -> np.ndarray:
    """(N, C, H, W) in [-1, 1] -> (rows*cell, nrow*cell, 3) uint8, upscaled (nearest) so 16 px images stay legible."""
    x = x.detach().float().cpu()
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    n, _, h, w = x.shape
    scale = max(1, math.ceil(min_cell / max(h, w)))
    ncol = max(1, min(nrow, n))
    nrows = max(1, math.ceil(n / ncol))
    tiles = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    ch, cw = h * scale + pad, w * scale + pad
    out = np.full((nrows * ch + pad, ncol * cw + pad, 3), 255, dtype=np.uint8)
    for i, t in enumerate(tiles):
        r, c = divmod(i, ncol)
        big = t.repeat(scale, axis=0).repeat(scale, axis=1)
        out[pad + r * ch : pad + r * ch + h * scale, pad + c * cw : pad + c * cw + w * scale] = big
    return out


def save_grid(split: Split | torch.Tensor, path: str | os.PathLike, nrow: int = 8) -> str:
    """Write the images of `split` (or a raw image tensor) as one PNG grid, `nrow` images per row."""
    x = split.x if isinstance(split, Split) else split
    if len(x) == 0:
        raise ValueError(f"save_grid: nothing to draw for {path}")
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    Image.fromarray(grid_array(x, nrow)).save(path, format="PNG")
    return path
