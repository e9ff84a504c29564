"""Image-classification datasets from the Hugging Face hub or a local folder.

One code path for all of them: a hub id and a local folder both end up as a
`datasets.Dataset`, whose image and label columns are found by name (or by feature
type); the images stay encoded (feddata.lazy decodes a batch at a time, at the size asked).
All splits are concatenated; feddata makes its own public/test/client split.

A local folder is one of: a `save_to_disk` folder; parquet files; or image files, read by HF's
`imagefolder` loader (offline): one sub-folder per class (class names = folder names, sorted),
optionally under split folders (train/, test/, ...) or domain folders (<domain>/<class>/<image>), or a
metadata.csv/.jsonl/.parquet with a `file_name` and a label column.

A `domain` column (a hub dataset's, or a metadata file's), or else domain folders, give each image its
domain: the `domain` and `dirichlet-domain` partitioners split by it.
"""

from __future__ import annotations

import os
import re

import numpy as np

from .builtin import BUILTINS, DIGIT_NAMES
from .lazy import ImageSource
from .types import BaseData, DatasetInfo, config_error

HUB_ALIASES = {"cifar10": "uoft-cs/cifar10", "mnist": "ylecun/mnist"}
IMAGE_COLUMNS = ("img", "image")
LABEL_COLUMNS = ("label", "labels", "fine_label")
DOMAIN_COLUMN = "domain"
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


def _column_ids(ds, column: str) -> tuple[np.ndarray, list[str]]:
    """A label-like column -> (int64 id per row, names): a ClassLabel's own numbering, else the sorted
    distinct values (stable across processes)."""
    import datasets

    raw = np.asarray(ds[column])
    feat = ds.features[column]
    if isinstance(feat, datasets.ClassLabel):
        return raw.astype(np.int64), list(feat.names)
    values, ids = np.unique(raw, return_inverse=True)
    return ids.astype(np.int64), [str(v) for v in values]


def _split_folder_names() -> frozenset[str]:
    from datasets.data_files import SPLIT_KEYWORDS

    return frozenset(k for words in SPLIT_KEYWORDS.values() for k in words)


def folder_domains(ds, img_col: str, root: str) -> tuple[np.ndarray, list[str]] | None:
    """Domains from an image folder's layout <domain>/<class>/<image> (every image two folders down, the
    top ones not split names such as train/test), as imagefolder reads the class from the inner folder;
    None for any other layout."""
    import datasets

    paths = [e["path"] for e in ds.cast_column(img_col, datasets.Image(decode=False))[img_col]]
    if not paths or not all(isinstance(p, str) for p in paths):
        return None
    root = os.path.realpath(root)
    parts = [os.path.relpath(os.path.realpath(p), root).split(os.sep) for p in paths]
    top = np.array([p[0] for p in parts])
    if any(len(p) != 3 for p in parts) or set(top.tolist()) & _split_folder_names():
        return None
    values, ids = np.unique(top, return_inverse=True)
    return ids.astype(np.int64), [str(v) for v in values]


def domains_of(ds, img_col: str, dataset: str) -> tuple[np.ndarray, list[str]] | None:
    """Each image's domain id and the domain names: the `domain` column, else an image folder's domain
    folders; None when the dataset has neither."""
    if DOMAIN_COLUMN in ds.column_names:
        return _column_ids(ds, DOMAIN_COLUMN)
    folder = _target(dataset)
    if os.path.isdir(folder) and _is_image_folder(folder):
        return folder_domains(ds, img_col, folder)
    return None


def load(dataset: str, image_size: int) -> BaseData:
    """Load and find the columns; the images stay encoded (BaseData.split gives LazyImages at image_size)."""
    import datasets

    ds = load_hf(dataset)
    img_col = _find_column(ds, IMAGE_COLUMNS, datasets.Image, "image", dataset)
    folder = _target(dataset)
    hint = f"; {_IMAGE_FOLDER_LABELS}" if os.path.isdir(folder) and _is_image_folder(folder) else ""
    lab_col = _find_column(ds, LABEL_COLUMNS, datasets.ClassLabel, "label", dataset, hint)
    y, names = _column_ids(ds, lab_col)
    if dataset == "mnist":  # "0".."9" -> words, so prompts read "a photo of the digit three"
        names = list(DIGIT_NAMES)
    attrs, attributes = {}, {}
    domains = domains_of(ds, img_col, dataset)
    if domains is not None:
        attrs["domain"], attributes["domain"] = domains
    info = DatasetInfo(dataset, len(names), names, attributes, image_size)
    return BaseData(ImageSource(ds, img_col), y, attrs, np.arange(len(y), dtype=np.int64), info)
