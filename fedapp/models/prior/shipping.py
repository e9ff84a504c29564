"""Shipping the built-in prior in a message, as Flower records.

Its weights go as one ArrayRecord (every tensor of every *.safetensors file, keyed
"<file>::<tensor>"), which Flower chunks like any model; its small files (component configs, the
tokenizer's vocabulary) go as one ConfigRecord of bytes. A client rebuilds the folder in its prior
cache, content-addressed, and loads it with from_pretrained like any other. A folder or hub prior is
never shipped: every node loads it from its own disk or cache.
"""

from __future__ import annotations

import hashlib
from pathlib import Path, PurePosixPath

import torch
from flwr.app import ArrayRecord, ConfigRecord

from .tiny.cache import cache_root, publish

WEIGHTS = ".safetensors"
FILES = (".json", ".txt")  # configs, model_index.json, prior_meta.json, tokenizer vocabulary
LEFT_HOME = (".png",)  # the sample grid evaluate.py writes beside the model: not part of it, never sent
SEP = "::"


def prior_to_records(folder: str | Path) -> tuple[ArrayRecord, ConfigRecord]:
    """(weights, files) of a prior folder; a sample grid stays home (LEFT_HOME), any other kind of file is
    refused (a .bin, a script)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    weights: dict[str, torch.Tensor] = {}
    files: dict[str, bytes] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel.endswith(WEIGHTS):
            for name, tensor in load_file(str(path)).items():
                weights[f"{rel}{SEP}{name}"] = tensor
        elif rel.endswith(FILES):
            files[rel] = path.read_bytes()
        elif not rel.endswith(LEFT_HOME):
            raise ValueError(f"prior folder {folder}: cannot ship {rel}; only {WEIGHTS} weights and "
                             f"{', '.join(FILES)} files")
    return ArrayRecord(weights), ConfigRecord(files)


def _safe(rel: str, suffixes: tuple[str, ...]) -> PurePosixPath:
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not rel.endswith(suffixes):
        raise ValueError(f"shipped prior: refusing path {rel!r}")
    return p


def prior_from_records(weights: ArrayRecord, files: ConfigRecord, cache_dir: str | Path | None = None) -> Path:
    """Rebuild the folder into `<root>/shipped-<sha256[:16]>` (reused when present). Only relative
    paths to weight and config files are accepted: the records come from the network."""
    from safetensors.torch import save_file

    by_file: dict[str, dict[str, torch.Tensor]] = {}
    digest = hashlib.sha256()
    for key in sorted(weights.keys()):
        rel, _, name = key.partition(SEP)
        _safe(rel, (WEIGHTS,))
        array = weights[key]
        digest.update(key.encode() + array.data)
        by_file.setdefault(rel, {})[name] = torch.from_numpy(array.numpy().copy())
    for rel in sorted(files.keys()):
        _safe(rel, FILES)
        if not isinstance(files[rel], bytes):
            raise ValueError(f"shipped prior: {rel!r} is not bytes")
        digest.update(rel.encode() + files[rel])
    folder = cache_root(cache_dir) / f"shipped-{digest.hexdigest()[:16]}"
    if folder.is_dir():
        return folder

    def write(tmp: Path) -> None:
        for rel, tensors in by_file.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(tmp / rel))
        for rel in files.keys():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(files[rel])

    return publish(folder, write)
