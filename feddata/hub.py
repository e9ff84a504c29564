"""Image-classification datasets from the Hugging Face hub or a local folder.

One code path for all of them: a hub id and a local folder both end up as a
`datasets.Dataset`, whose image and label columns are found by name (or by feature
type), then decoded to RGB, resized and stored as uint8. All splits are concatenated;
feddata makes its own public/test/client split.

A local folder is one of: a `save_to_disk` folder; parquet files; or image files, read by HF's
`imagefolder` loader (offline): one sub-folder per class (class names = folder names, sorted),
optionally under split folders (train/, test/, ...), or a metadata.csv/.jsonl/.parquet with a
`file_name` and a label column.
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch
from PIL import Image

from .builtin import BUILTINS, DIGIT_NAMES
from .types import BaseData, DatasetInfo, config_error

HUB_ALIASES = {"cifar10": "uoft-cs/cifar10", "mnist": "ylecun/mnist"}
IMAGE_COLUMNS = ("img", "image")
LABEL_COLUMNS = ("label", "labels", "fine_label")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_ALLOWED = ("a built-in name, an HF dataset id (owner/name), or a folder: saved with save_to_disk, holding parquet "
            "files, or images in one sub-folder per class (HF imagefolder layout)")
_IMAGE_FOLDER_LABELS = ("an image folder needs one sub-folder per class (two or more) "
                        "or a metadata file with a label column")


def _is_saved_dataset(path: str) -> bool:
    names = set(os.listdir(path))
    return bool(names & {"dataset_dict.json", "state.json", "dataset_info.json"}) and not any(
        n.endswith(".parquet") for n in names
    )


def _image_extensions() -> frozenset[str]:
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    return frozenset(e.lower() for e in ImageFolder.EXTENSIONS)


def _is_image_folder(path: str) -> bool:
    """True if the first data file met below `path` is an image (what imagefolder reads); a
    parquet/arrow table (other than a metadata file) first means a table dataset."""
    images = _image_extensions()
    for _, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            ext = os.path.splitext(name)[1].lower()
            if ext in images:
                return True
            if ext in (".parquet", ".arrow") and not name.startswith("metadata."):
                return False
    return False


def _target(dataset: str) -> str:
    """What `dataset` names: an alias's hub id, else the string itself (a folder or hub id)."""
    return HUB_ALIASES.get(dataset, os.path.expanduser(dataset))


def hub_dataset_id(dataset: str) -> str | None:
    """The hub repository `dataset` would load from (an alias's id, or the id itself); None for a built-in,
    an existing folder, or a name `load_hf` refuses without asking the hub."""
    target = _target(dataset)
    if (dataset in BUILTINS or os.path.isdir(target) or dataset.startswith((".", "~", "/"))
            or dataset.count("/") > 1 or not _HUB_ID.match(target)):
        return None
    return target


def _snake(name: str) -> str:
    """datasets' camelcase_to_snakecase (datasets/naming.py), which names a dataset's cache folder."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z\d])([A-Z])", r"\1_\2", name).lower()


def hub_dataset_cached(repo_id: str) -> bool:
    """Whether `datasets` can load hub dataset `repo_id` without the hub: its files are in the Hugging Face
    hub cache (datasets--owner--name) or a prepared copy is in the datasets cache (owner___name, what
    `load_dataset` falls back to offline)."""
    from huggingface_hub import constants

    parts = repo_id.split("/")
    hub_dir = os.path.join(constants.HF_HUB_CACHE, "datasets--" + "--".join(parts))
    datasets_cache = os.path.expanduser(os.environ.get("HF_DATASETS_CACHE")
                                        or os.path.join(constants.HF_HOME, "datasets"))
    prepared = os.path.join(datasets_cache, "___".join(parts[:-1] + [_snake(parts[-1])]))
    return os.path.isdir(os.path.join(hub_dir, "snapshots")) or os.path.isdir(prepared)


def load_hf(dataset: str):
    """The raw `datasets.Dataset` (all splits concatenated in name order)."""
    import datasets

    target = _target(dataset)
    try:
        if os.path.isdir(target):
            if _is_saved_dataset(target):
                ds = datasets.load_from_disk(target)
            elif _is_image_folder(target):  # explicit: inference from file counts could pick another builder
                ds = datasets.load_dataset("imagefolder", data_dir=target)
            else:
                ds = datasets.load_dataset(target)
        elif dataset.startswith((".", "~", "/")) or dataset.count("/") > 1:
            raise config_error("dataset", dataset, f"no such folder; allowed: {_ALLOWED}")
        elif not _HUB_ID.match(target):
            raise config_error("dataset", dataset, f"not a dataset name; allowed: {_ALLOWED}")
        else:
            ds = datasets.load_dataset(target)
    except ValueError:
        raise
    except Exception as e:  # no network, no such repo, unreadable folder: one line for the user
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise config_error("dataset", dataset,
                           f"could not load ({type(e).__name__}: {msg[:200]}); allowed: {_ALLOWED}") from e
    if isinstance(ds, datasets.DatasetDict):
        ds = datasets.concatenate_datasets([ds[k] for k in sorted(ds)])
    return ds


def _find_column(ds, names: tuple[str, ...], feature_type, what: str, dataset: str, hint: str = "") -> str:
    for name in names:
        if name in ds.column_names:
            return name
    for name, feat in ds.features.items():
        if isinstance(feat, feature_type):
            return name
    raise config_error("dataset", dataset,
                       f"no {what} column (looked for {'/'.join(names)}); columns: {ds.column_names}{hint}")


def _to_rgb(img, size: int) -> np.ndarray:
    if not isinstance(img, Image.Image):
        img = Image.fromarray(np.asarray(img))
    return np.asarray(img.convert("RGB").resize((size, size), Image.BILINEAR), dtype=np.uint8)


def decode(dataset: str, image_size: int) -> BaseData:
    """Load, find columns, convert every image to (3, size, size) uint8."""
    import datasets

    ds = load_hf(dataset)
    img_col = _find_column(ds, IMAGE_COLUMNS, datasets.Image, "image", dataset)
    folder = _target(dataset)
    hint = f"; {_IMAGE_FOLDER_LABELS}" if os.path.isdir(folder) and _is_image_folder(folder) else ""
    lab_col = _find_column(ds, LABEL_COLUMNS, datasets.ClassLabel, "label", dataset, hint)
    raw = np.asarray(ds[lab_col])
    feat = ds.features[lab_col]
    if isinstance(feat, datasets.ClassLabel):
        names, y = list(feat.names), raw.astype(np.int64)
    else:  # plain values: number them in sorted order so ids are stable
        values, y = np.unique(raw, return_inverse=True)
        names, y = [str(v) for v in values], y.astype(np.int64)
    if dataset == "mnist":  # "0".."9" -> words, so prompts read "a photo of the digit three"
        names = list(DIGIT_NAMES)
    imgs = np.empty((len(ds), image_size, image_size, 3), dtype=np.uint8)
    i = 0
    for batch in ds.select_columns([img_col]).iter(batch_size=512):
        for img in batch[img_col]:
            imgs[i] = _to_rgb(img, image_size)
            i += 1
    x = torch.from_numpy(imgs).permute(0, 3, 1, 2).contiguous()
    info = DatasetInfo(dataset, len(names), names, {}, image_size)
    return BaseData(x, y, {}, np.arange(len(y), dtype=np.int64), info)
