"""The data containers every method receives: plain tensors, no Flower or HF types."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .lazy import ImageSource, LazyImages
from .validation import refuse


@dataclass
class Split:
    """A set of images with labels and per-sample attributes.

    `index` (row of each sample in the dataset's base table) and `source` (id of the
    underlying source image; one digit rendered in four styles shares one id) are
    provenance, kept apart from `attrs` so that code iterating over attributes only
    sees semantic ones. Both are None for data that does not come from feddata
    (e.g. synthetic images).
    """

    x: torch.Tensor | LazyImages  # (N, C, H, W) float32 in [-1, 1]; a hub dataset's or folder's decode per batch
    y: torch.Tensor  # (N,) int64
    attrs: dict[str, torch.Tensor] = field(default_factory=dict)  # each (N,) int64
    index: torch.Tensor | None = None  # (N,) int64 row in the base table
    source: torch.Tensor | None = None  # (N,) int64 source-image id

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, idx) -> Split:
        if isinstance(idx, np.ndarray):
            idx = torch.from_numpy(idx)
        elif isinstance(idx, (list, tuple)):
            idx = torch.as_tensor(idx, dtype=torch.long)
        return Split(
            x=self.x.take(idx) if isinstance(self.x, LazyImages) else self.x[idx],
            y=self.y[idx],
            attrs={k: v[idx] for k, v in self.attrs.items()},
            index=None if self.index is None else self.index[idx],
            source=None if self.source is None else self.source[idx],
        )


@dataclass
class DatasetInfo:
    name: str
    num_classes: int
    class_names: list[str]
    attributes: dict[str, list[str]]  # attribute name -> value names
    image_size: int
    channels: int = 3


@dataclass
class ClientShard:
    train: Split
    test: Split
    info: DatasetInfo
    meta: dict  # JSON-serialisable facts about this client's partition


@dataclass
class ServerData:
    public: Split  # disjoint from every client and from test
    test: Split  # global test set
    info: DatasetInfo
    meta: dict


def config_error(key: str, value, why: str) -> ValueError:
    """The one-line user error the whole app uses: key, value, what is allowed (feddata.validation.refuse)."""
    return refuse(key, value, why)


@dataclass
class BaseData:
    """A dataset's whole table, once per process: a built-in rendered (uint8 keeps it small), a hub dataset or
    folder as its encoded images (decoded a batch at a time by the splits' LazyImages)."""

    x: torch.Tensor | ImageSource  # (N, 3, H, W) uint8, or the encoded images
    y: np.ndarray  # (N,) int64
    attrs: dict[str, np.ndarray]  # each (N,) int64
    source: np.ndarray  # (N,) int64 source-image id; the public/test/pool split is by source
    info: DatasetInfo

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def split(self, rows: np.ndarray) -> Split:
        rows = np.array(rows, dtype=np.int64)  # a copy: cached row arrays are read-only
        rows_t = torch.from_numpy(rows)
        x = (LazyImages(self.x, rows, self.info.image_size) if isinstance(self.x, ImageSource)
             else self.x[rows_t].float().div_(127.5).sub_(1.0))
        return Split(
            x=x,
            y=torch.as_tensor(self.y[rows], dtype=torch.long),
            attrs={k: torch.as_tensor(v[rows], dtype=torch.long) for k, v in self.attrs.items()},
            index=rows_t.clone(),
            source=torch.as_tensor(self.source[rows], dtype=torch.long),
        )
