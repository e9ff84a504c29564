"""Dataset name -> the cached base table, and its fixed public / test / client-pool split."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from . import builtin, hub
from .types import BaseData, DatasetInfo
from .validation import Rule, refuse

DATASETS: tuple[str, ...] = builtin.BUILTINS + tuple(hub.HUB_ALIASES)
PUBLIC_FRACTION = 0.15
TEST_FRACTION = 0.15
# The three-way split uses its own fixed seed, not the run seed: a prior pre-trained on the
# public split can then be cached once per dataset and has never seen any run's test data.
SPLIT_SEED = 20240601
# image-size, pixels per side: one rule for every dataset (and the app's image-size and classifier-size keys).
# A hub dataset or folder is decoded a batch at a time (feddata.lazy): its size costs memory per batch, not per
# dataset, up to the largest prior resolution in use (SD-XL's 1024 px). A built-in is rendered whole, in memory,
# at the size asked: it stops at builtin.MAX_SIZE.
IMAGE_SIZE = Rule(int, low=builtin.MIN_SIZE, high=1024, help="pixels per side")
BUILTIN_IMAGE_SIZE = dataclasses.replace(IMAGE_SIZE, high=builtin.MAX_SIZE,
                                         reason="a built-in dataset is rendered whole in memory at the size asked; "
                                                "upsample downstream instead")


def native_size(dataset: str) -> int:
    """The image size a dataset comes at when none is asked for (image_size=None): a built-in's own
    (28 for the MNIST sets, 16 for the 8x8 ones), 16 for a hub dataset or folder (their images vary)."""
    return builtin.native_size(dataset) if dataset in builtin.BUILTINS else 16


def check_image_size(dataset: str, image_size) -> int:
    """An int in the dataset's range; None means its native size."""
    if image_size is None:
        return native_size(dataset)
    return (BUILTIN_IMAGE_SIZE if dataset in builtin.BUILTINS else IMAGE_SIZE).check("image-size", image_size)


def check_dataset(dataset) -> str:
    if not isinstance(dataset, str) or not dataset.strip():
        raise refuse("dataset", dataset, f"must be one of {', '.join(DATASETS)}, an HF dataset id or a folder")
    return dataset


def load_base(dataset: str, image_size: int | None = None) -> BaseData:
    """Rendered (built-in) or encoded (hub/folder, decoded per batch) table; once per process per size (None =
    native, resolved before the cache so that None and the native size share one table)."""
    check_dataset(dataset)
    return _load_base(dataset, check_image_size(dataset, image_size))


@functools.lru_cache(maxsize=8)
def _load_base(dataset: str, image_size: int) -> BaseData:
    if dataset in builtin.BUILTINS:
        return builtin.render(dataset, image_size)
    return hub.load(dataset, image_size)


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
    """Forget every rendered/loaded table and split (tests check that a rebuild gives the same data)."""
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
