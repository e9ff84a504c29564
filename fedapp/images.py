"""Image grids as PNGs: every grid a run or a doc writes goes through here.

The tiling itself is feddata.preview.grid_array (feddata cannot import fedapp; the reverse is fine),
so a grid written by a run looks like one written by feddata's previews. Images are (N, C, H, W) in
[-1, 1] throughout.
"""

from __future__ import annotations

import os

import torch


def sample_grid(images: torch.Tensor, rows: int, path: str | os.PathLike, scale: int = 3) -> None:
    """Save images (rows*cols, C, H, W) as one PNG, row-major (rows = classes), each pixel scale x scale,
    no gaps; images beyond rows * (N // rows) are left out."""
    from PIL import Image

    from feddata.preview import grid_array

    cols = len(images) // rows
    h, w = images.shape[-2:]
    Image.fromarray(grid_array(images[: rows * cols], nrow=cols, pad=0, min_cell=max(h, w) * scale)).save(path)


def synthetic_grid(x: torch.Tensor, y: torch.Tensor, num_classes: int, cols: int = 8) -> torch.Tensor:
    """(num_classes * cols, C, H, W): the first `cols` images of each class, black where there are fewer."""
    tiles = torch.full((num_classes, cols, *x.shape[1:]), -1.0)
    for c in range(num_classes):
        xc = x[y == c][:cols]
        tiles[c, :len(xc)] = xc
    return tiles.flatten(0, 1)


def save_class_grid(x: torch.Tensor, y: torch.Tensor, num_classes: int, path: str | os.PathLike, cols: int = 8,
                    trim: bool = False) -> None:
    """One row per class, the first `cols` images of each (synthetic_grid) as a PNG. trim: fewer columns,
    as many as the smallest class has, instead of black cells."""
    if trim:
        cols = min([cols] + [int((y == c).sum()) for c in range(num_classes)])
    sample_grid(synthetic_grid(x, y, num_classes, cols), num_classes, path)


def save_pair_grid(samples: dict[str, tuple[torch.Tensor, torch.Tensor]], sizes: list[int], novel: list[list[int]],
                   path: str | os.PathLike) -> None:
    """A (digit x colour) grid, one sample per cell: samples maps a kind to (x, y) with y[:, 0] the digit
    and y[:, 1] the colour; cells of `novel` pairs are framed in white, cells with no sample stay black."""
    d, c = sizes
    x_all = torch.cat([samples[k][0] for k in samples])
    y_all = torch.cat([samples[k][1] for k in samples])
    ch, h, w = x_all.shape[1:]
    pad = 2
    cell_h, cell_w = h + 2 * pad, w + 2 * pad
    cells = torch.full((d, c, ch, cell_h, cell_w), -1.0)
    novel_set = {tuple(p) for p in novel}
    for a in range(d):
        for b in range(c):
            hit = ((y_all[:, 0] == a) & (y_all[:, 1] == b)).nonzero()
            if len(hit) == 0:
                continue
            if (a, b) in novel_set:
                cells[a, b] = 1.0  # frame: a novel pair
            cells[a, b, :, pad:pad + h, pad:pad + w] = x_all[int(hit[0])]
    # cells about 128 px on screen whatever the image size
    sample_grid(cells.flatten(0, 1), d, path, scale=max(1, 128 // cell_h))
