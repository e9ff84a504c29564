"""Image grids as PNGs: every grid a run or a doc writes goes through here.

The tiling itself is feddata.preview.grid_array (feddata cannot import fedapp; the reverse is fine),
so a grid written by a run looks like one written by feddata's previews. Images are (N, C, H, W) in
[-1, 1] throughout.
"""

from __future__ import annotations

import os

import torch


ROW_LABELS_KEY = "row-labels"  # the PNG text chunk that lists a grid's row labels (a JSON list)


def sample_grid(images: torch.Tensor, rows: int, path: str | os.PathLike, scale: int = 3,
                row_labels: list[str] | None = None) -> list[str]:
    """Save images (rows*cols, C, H, W) as one PNG, row-major (rows = classes), each pixel scale x scale,
    no gaps; images beyond rows * (N // rows) are left out. row_labels: one per row, written left of it
    (and kept in the PNG's ROW_LABELS_KEY text chunk); returns the labels drawn."""
    from PIL import Image

    from feddata.preview import grid_array

    cols = len(images) // rows
    h, w = images.shape[-2:]
    img = Image.fromarray(grid_array(images[: rows * cols], nrow=cols, pad=0, min_cell=max(h, w) * scale))
    if not row_labels:
        img.save(path)
        return []
    labels = [str(t) for t in row_labels]
    if len(labels) != rows:
        raise ValueError(f"{len(labels)} row labels for {rows} rows")
    img, info = _with_row_labels(img, labels)
    img.save(path, pnginfo=info)
    return labels


def _with_row_labels(img, labels: list[str]):
    """The grid with a white margin on its left, each row's label right-aligned in it beside the row's middle;
    and the PNG text chunk that lists them."""
    import json

    from PIL import Image, ImageDraw, ImageFont
    from PIL.PngImagePlugin import PngInfo

    cell = img.height / len(labels)
    try:  # a scalable font sized to the row (Pillow >= 10.1 with FreeType), else Pillow's bitmap one
        font = ImageFont.load_default(size=max(10, min(int(cell * 0.3), 22)))
    except (TypeError, OSError, ImportError):
        font = ImageFont.load_default()
    gap = max(4, int(cell * 0.08))
    width = max(ImageDraw.Draw(img).textlength(t, font=font) for t in labels)
    margin = int(width) + 2 * gap
    out = Image.new("RGB", (img.width + margin, img.height), "white")
    out.paste(img.convert("RGB"), (margin, 0))
    draw = ImageDraw.Draw(out)
    for r, text in enumerate(labels):
        draw.text((margin - gap, (r + 0.5) * cell), text, fill="black", font=font, anchor="rm")
    info = PngInfo()
    info.add_text(ROW_LABELS_KEY, json.dumps(labels))
    return out, info


def read_row_labels(path: str | os.PathLike) -> list[str]:
    """The row labels a grid PNG was written with (sample_grid's row_labels), [] when none."""
    import json

    from PIL import Image

    with Image.open(path) as im:
        return json.loads(im.text.get(ROW_LABELS_KEY, "[]"))


def synthetic_grid(x: torch.Tensor, y: torch.Tensor, num_classes: int, cols: int = 8) -> torch.Tensor:
    """(num_classes * cols, C, H, W): the first `cols` images of each class, black where there are fewer."""
    tiles = torch.full((num_classes, cols, *x.shape[1:]), -1.0)
    for c in range(num_classes):
        xc = x[y == c][:cols]
        tiles[c, :len(xc)] = xc
    return tiles.flatten(0, 1)


def save_class_grid(x: torch.Tensor, y: torch.Tensor, num_classes: int, path: str | os.PathLike, cols: int = 8,
                    trim: bool = False, class_names: list[str] | None = None) -> list[str]:
    """One row per class, the first `cols` images of each (synthetic_grid) as a PNG, each row labelled with
    its class name when class_names are given; returns the row labels drawn. trim: fewer columns, as many as
    the smallest class has, instead of black cells."""
    if class_names is not None and len(class_names) != num_classes:
        raise ValueError(f"{len(class_names)} class names for {num_classes} classes")
    if trim:
        cols = min([cols] + [int((y == c).sum()) for c in range(num_classes)])
    return sample_grid(synthetic_grid(x, y, num_classes, cols), num_classes, path, row_labels=class_names)


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
