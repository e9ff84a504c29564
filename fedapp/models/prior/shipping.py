"""Shipping the built-in prior in a message, as Flower records.

Its weights go as one ArrayRecord (every tensor of every *.safetensors file, keyed
"<file>::<tensor>"), which Flower chunks like any model; its small files (component configs, the
tokenizer's vocabulary) go as one ConfigRecord of bytes. A client rebuilds the folder in its prior
cache, content-addressed (`shipped-<sha256[:16]>`), and loads it with from_pretrained like any other. The
sha256 over the records (`records_digest`) names the prior in messages: a node that already holds a folder
with that digest needs no weights (`cached_shipped` checks the folder's content against it). A folder or
hub prior is never shipped: every node loads it from its own disk or cache.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path, PurePosixPath

import torch
from flwr.app import ArrayRecord, ConfigRecord

from .tiny.cache import cache_root, publish

WEIGHTS = ".safetensors"
FILES = (".json", ".txt")  # configs, model_index.json, prior_meta.json, tokenizer vocabulary
LEFT_HOME = (".png",)  # the sample grid fedapp.prior_evaluation writes beside the model: not part of it, never sent
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


def records_digest(weights: ArrayRecord, files: ConfigRecord) -> str:
    """sha256 (hex) of a shipped prior's records: every tensor's key and bytes, every file's path and bytes.
    Only relative paths to weight and config files are accepted: the records come from the network."""
    digest = hashlib.sha256()
    for key in sorted(weights.keys()):
        _safe(key.partition(SEP)[0], (WEIGHTS,))
        digest.update(key.encode() + weights[key].data)
    for rel in sorted(files.keys()):
        _safe(rel, FILES)
        if not isinstance(files[rel], bytes):
            raise ValueError(f"shipped prior: {rel!r} is not bytes")
        digest.update(rel.encode() + files[rel])
    return digest.hexdigest()


def shipped_folder(digest: str, cache_dir: str | Path | None = None) -> Path:
    return cache_root(cache_dir) / f"shipped-{digest[:16]}"


_VERIFIED: set[tuple[str, str]] = set()  # (folder, digest) pairs this process has checked


def cached_shipped(digest: str, cache_dir: str | Path | None = None) -> Path | None:
    """This node's folder of the shipped prior with that digest, its content checked against it (once per
    process); None when it lacks one or the folder's content differs. Never raises."""
    try:
        folder = shipped_folder(str(digest), cache_dir)
        if (str(folder), digest) in _VERIFIED:
            return folder if folder.is_dir() else None
        if not folder.is_dir() or records_digest(*prior_to_records(folder)) != digest:
            return None
        _VERIFIED.add((str(folder), digest))
        return folder
    except Exception:  # noqa: BLE001 - a damaged folder is a folder this node lacks
        return None


def prior_from_records(weights: ArrayRecord, files: ConfigRecord, cache_dir: str | Path | None = None,
                       expect: str | None = None) -> Path:
    """Rebuild the folder into `<root>/shipped-<sha256[:16]>` (reused when present and whole). `expect`: the
    digest the sender named; records that hash otherwise are refused."""
    from safetensors.torch import save_file

    digest = records_digest(weights, files)
    if expect is not None and digest != expect:
        raise ValueError(f"shipped prior: its records hash to {digest[:16]}…, not the announced {expect[:16]}…")
    folder = shipped_folder(digest, cache_dir)
    if cached_shipped(digest, cache_dir) is not None:
        return folder
    if folder.is_dir():  # there, but not what its name says: replace it
        shutil.rmtree(folder, ignore_errors=True)
    by_file: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted(weights.keys()):
        rel, _, name = key.partition(SEP)
        by_file.setdefault(rel, {})[name] = torch.from_numpy(weights[key].numpy().copy())

    def write(tmp: Path) -> None:
        for rel, tensors in by_file.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(tmp / rel))
        for rel in files.keys():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(files[rel])

    return publish(folder, write)
