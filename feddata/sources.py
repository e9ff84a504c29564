"""Dataset name -> the cached base table, and its fixed public / test / client-pool split."""

from __future__ import annotations

import functools

import numpy as np

from . import builtin, hub
from .types import BaseData, DatasetInfo, config_error

DATASETS: tuple[str, ...] = builtin.BUILTINS + tuple(hub.HUB_ALIASES)
PUBLIC_FRACTION = 0.15
TEST_FRACTION = 0.15
# The three-way split uses its own fixed seed, not the run seed: a prior pre-trained on the
# public split can then be cached once per dataset and has never seen any run's test data.
SPLIT_SEED = 20240601


def native_size(dataset: str) -> int:
    """The image size a dataset comes at when none is asked for (image_size=None): a built-in's own
    (28 for the MNIST sets, 16 for the 8x8 ones), 16 for a hub dataset or folder (their images vary)."""
    return builtin.native_size(dataset) if dataset in builtin.BUILTINS else 16


def check_image_size(dataset: str, image_size) -> int:
    """An int in the dataset's range; None means its native size."""
    if image_size is None:
        return native_size(dataset)
    lo, hi = (builtin.MIN_SIZE, builtin.MAX_SIZE) if dataset in builtin.BUILTINS else (4, 256)
    if isinstance(image_size, bool) or not isinstance(image_size, (int, np.integer)) or not lo <= image_size <= hi:
        raise config_error("image-size", image_size, f"must be an int in [{lo}, {hi}] for dataset {dataset}")
    return int(image_size)


def check_dataset(dataset) -> str:
    if not isinstance(dataset, str) or not dataset.strip():
        raise config_error("dataset", dataset, f"must be one of {', '.join(DATASETS)}, an HF dataset id or a folder")
    return dataset


def load_base(dataset: str, image_size: int | None = None) -> BaseData:
    """Rendered (built-in) or decoded (hub/folder) table; once per process per size (None = native,
    resolved before the cache so that None and the native size share one table)."""
    check_dataset(dataset)
    return _load_base(dataset, check_image_size(dataset, image_size))


@functools.lru_cache(maxsize=8)
def _load_base(dataset: str, image_size: int) -> BaseData:
    if dataset in builtin.BUILTINS:
        return builtin.render(dataset, image_size)
    return hub.decode(dataset, image_size)


def dataset_info(dataset: str, image_size: int | None = None) -> DatasetInfo:
    check_dataset(dataset)
    image_size = check_image_size(dataset, image_size)
    if dataset in builtin.BUILTINS:  # no rendering needed
        return builtin.builtin_info(dataset, image_size)
    return load_base(dataset, image_size).info


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False  # cached and shared between callers
    return a


def base_split(dataset: str, image_size: int | None = None) -> dict[str, np.ndarray]:
    """Rows of the public, test and client-pool parts: disjoint by source image, stratified by class.
    The rows do not depend on the image size; the size only picks which cached table is read."""
    check_dataset(dataset)
    return _base_split(dataset, check_image_size(dataset, image_size))


def clear_caches() -> None:
    """Forget every rendered/decoded table and split (tests check that a rebuild gives the same data)."""
    _load_base.cache_clear()
    _base_split.cache_clear()
    builtin.clear_caches()


@functools.lru_cache(maxsize=8)
def _base_split(dataset: str, image_size: int) -> dict[str, np.ndarray]:
    b = _load_base(dataset, image_size)
    src_ids, first = np.unique(b.source, return_index=True)
    src_label = b.y[first]
    rng = np.random.default_rng(SPLIT_SEED)
    part = np.full(len(src_ids), 2, dtype=np.int64)  # 0 public, 1 test, 2 pool
    for c in np.unique(src_label):
        ids = rng.permutation(np.flatnonzero(src_label == c))
        n_pub = int(round(PUBLIC_FRACTION * len(ids)))
        n_test = int(round(TEST_FRACTION * len(ids)))
        part[ids[:n_pub]] = 0
        part[ids[n_pub : n_pub + n_test]] = 1
    row_part = part[np.searchsorted(src_ids, b.source)]
    return {name: _readonly(np.flatnonzero(row_part == k)) for k, name in enumerate(("public", "test", "pool"))}
