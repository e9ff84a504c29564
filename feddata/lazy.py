"""Hub and folder images decoded a batch at a time, at whatever size the reader asks for.

A hub dataset or folder stays what `datasets` keeps it as (memory-mapped Arrow rows: encoded bytes or file
paths) and a split's `x` is a `LazyImages`: rows of that table and a size. Indexing it (`x[idx]`, `x[a:b]`,
what every training and evaluation loop does) decodes and resizes those rows only, so 512 or 768 px costs
memory a batch, not a dataset; `at(size)` is the same rows at another size (a classifier reading at its own
size while a prior reads at its own).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image


def to_rgb(img, size: int) -> np.ndarray:
    """One decoded image -> (size, size, 3) uint8: RGB, bilinear resize."""
    if not isinstance(img, Image.Image):
        img = Image.fromarray(np.asarray(img))
    return np.asarray(img.convert("RGB").resize((size, size), Image.BILINEAR), dtype=np.uint8)


class ImageSource:
    """A `datasets.Dataset`'s image column, decoded on request: `datasets` decodes only the rows indexed."""

    def __init__(self, ds, column: str):
        self.ds = ds.select_columns([column])
        self.column = column

    def __len__(self) -> int:
        return len(self.ds)

    def decode(self, rows: np.ndarray, size: int) -> torch.Tensor:
        """Rows (B,) of the table -> (B, 3, size, size) uint8."""
        if len(rows) == 0:
            return torch.empty(0, 3, size, size, dtype=torch.uint8)
        images = self.ds[[int(r) for r in rows]][self.column]
        return torch.from_numpy(np.stack([to_rgb(im, size) for im in images])).permute(0, 3, 1, 2).contiguous()


class LazyImages(torch.utils.data.Dataset):
    """A split's images (N, 3, size, size) float32 in [-1, 1], decoded when indexed.

    `x[key]` takes what a tensor's first index takes (int, slice, index list/array/tensor, bool mask) and
    returns a tensor; `take(key)` the same rows as a LazyImages. Any other tensor operation on the whole
    (`torch.cat([x, ...])`, `x.float()`, `x * 2`) decodes every row first: what every split cost before
    decoding was lazy, and only the methods that treat their data as one tensor pay it."""

    def __init__(self, source: ImageSource, rows: np.ndarray, size: int):
        self.source = source
        self.rows = np.asarray(rows, dtype=np.int64)
        self.px = int(size)  # not `size`: that is a tensor's method, which this answers too

    # ---- what a tensor of images answers without decoding ------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.rows), 3, self.px, self.px))

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    dtype = torch.float32
    device = torch.device("cpu")
    ndim = 4

    def dim(self) -> int:
        return 4

    def __repr__(self) -> str:
        return f"LazyImages({len(self)} images at {self.px} px)"

    # ---- decoding -----------------------------------------------------------------------------------
    def _positions(self, key) -> torch.Tensor:
        if isinstance(key, np.ndarray):
            key = torch.from_numpy(key)
        return torch.arange(len(self.rows))[key]

    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, tuple):  # x[rows, channel, ...]: decode the rows, then index the rest
            head = self[key[0]]
            return head[key[1:]] if head.dim() == 3 else head[(slice(None), *key[1:])]
        pos = self._positions(key)
        x = self.source.decode(self.rows[pos.reshape(-1).numpy()], self.px).float().div_(127.5).sub_(1.0)
        return x[0] if pos.dim() == 0 else x

    def take(self, key) -> LazyImages:
        """The rows `key` selects, still undecoded."""
        return LazyImages(self.source, self.rows[self._positions(key).reshape(-1).numpy()], self.px)

    def at(self, size: int) -> LazyImages:
        """The same images decoded at `size` px."""
        return LazyImages(self.source, self.rows, size)

    def materialize(self) -> torch.Tensor:
        """Every image decoded: (N, 3, size, size)."""
        return self[:]

    # ---- any other tensor operation: on the decoded whole --------------------------------------------
    def __array__(self, dtype=None, copy=None):
        a = self.materialize().numpy()
        return a if dtype is None else a.astype(dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def decoded(a):
            if isinstance(a, LazyImages):
                return a.materialize()
            if isinstance(a, (list, tuple)):
                return type(a)(decoded(v) for v in a)
            return a

        return func(*decoded(args), **{k: decoded(v) for k, v in (kwargs or {}).items()})

    def __getattr__(self, name: str):
        # only tensor methods, and never while unpickling (before source/rows/size exist)
        if name.startswith("_") or name in ("source", "rows", "px") or not hasattr(torch.Tensor, name):
            raise AttributeError(name)
        return getattr(self.materialize(), name)


def _on_decoded(name: str):
    def method(self, *args):
        return getattr(self.materialize(), name)(*args)

    method.__name__ = name
    return method


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__neg__", "__pow__", "__matmul__", "__lt__", "__le__", "__gt__", "__ge__"):
    setattr(LazyImages, _name, _on_decoded(_name))


def at_size(x, size: int):
    """Images x (N, C, H, W) at size x size: x itself when it already is; a LazyImages decoded straight at
    `size`; a tensor resized (bilinear, with antialias when shrinking)."""
    if tuple(x.shape[-2:]) == (size, size):
        return x
    if isinstance(x, LazyImages):
        return x.at(size)
    if len(x) == 0:
        return x.new_zeros((0, *x.shape[1:-2], size, size))
    return F.interpolate(x.float(), size=(size, size), mode="bilinear", align_corners=False,
                         antialias=size < x.shape[-1])
