"""What the app calls: a client's shard and the server's data, as pure functions of their arguments.

Simulation and deployment call these in different processes and must get the same
tensors, so every draw comes from np.random.SeedSequence over (seed, partition id, tag),
never from Python's per-process hash or global RNG state.
"""

from __future__ import annotations

import functools

import numpy as np

from .partition import Assignment, check_partitioner, partition, resolve_params
from .sources import base_split, check_dataset, check_image_size, load_base
from .types import ClientShard, ServerData
from .validation import Rule

# The data calls' own arguments (the partitioner's parameters: feddata.partition.PARAMS)
SEED = Rule(int, 0, low=0, help="seeds every draw: the partition, client training, server sampling and evaluation")
NUM_PARTITIONS = Rule(int, low=1)
TEST_FRACTION = Rule(float, 0.2, low=0.0, high=1.0, high_open=True)


@functools.lru_cache(maxsize=32)
def _assignment(dataset: str, partitioner: str, params_key: tuple, seed: int, n: int, image_size: int) -> Assignment:
    b = load_base(dataset, image_size)
    return partition(b, base_split(dataset, image_size)["pool"], partitioner, dict(params_key), seed, n)


def _resolve(dataset, partitioner, params, seed, num_partitions, image_size) -> tuple[dict, Assignment, int]:
    """Checked params, the cached assignment, and the image size (None -> the dataset's native size)."""
    check_dataset(dataset)
    check_partitioner(partitioner)
    p = resolve_params(partitioner, params)
    seed = SEED.check("seed", seed)
    n = NUM_PARTITIONS.check("num-partitions", num_partitions)
    size = check_image_size(dataset, image_size)
    return p, _assignment(dataset, partitioner, tuple(sorted(p.items())), seed, n, size), size


def validate(dataset: str, partitioner: str, params: dict, num_partitions: int, seed: int = 0,
             image_size: int | None = None) -> dict:
    """Run every check (including dataset-dependent ones) and return the resolved params.
    Meant for config validation before any client work starts."""
    return _resolve(dataset, partitioner, params, seed, num_partitions, image_size)[0]


def _train_test(rows, labels, test_fraction, cap, rng) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split; the per-class cap trims training images only."""
    train, test = [], []
    for c in np.unique(labels):
        rc = rng.permutation(rows[labels == c])
        n_test = int(round(test_fraction * len(rc)))
        n_test = min(n_test, len(rc) - 1)  # a class the client has keeps >= 1 training image
        test.append(rc[:n_test])
        tr = rc[n_test:]
        train.append(tr[: cap[int(c)]] if int(c) in cap else tr)
    empty = np.empty(0, dtype=np.int64)
    train = rng.permutation(np.concatenate(train)) if train else empty  # shuffled: no class runs
    test = np.sort(np.concatenate(test)) if test else empty
    return train, test


def _shard_rows(a: Assignment, b, seed: int, pid: int, test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Base-table rows of client pid's train and test splits."""
    rows = a.rows[pid]
    rng = np.random.default_rng(np.random.SeedSequence([seed, pid, 11]))
    return _train_test(rows, b.y[rows], test_fraction, a.train_caps[pid], rng)


def load_client_shard(
    dataset: str,
    partitioner: str,
    params: dict,
    seed: int,
    partition_id: int,
    num_partitions: int,
    image_size: int | None = None,
    test_fraction: float = 0.2,
) -> ClientShard:
    """image_size None: the dataset's native size (feddata.native_size)."""
    p, a, image_size = _resolve(dataset, partitioner, params, seed, num_partitions, image_size)
    pid = Rule(int, low=0, high=num_partitions - 1).check("partition-id", partition_id)
    test_fraction = TEST_FRACTION.check("test-fraction", test_fraction)
    b = load_base(dataset, image_size)
    train, test = _shard_rows(a, b, seed, pid, test_fraction)
    meta = {
        **a.client_meta[pid],
        "partition_id": pid,
        "num_partitions": num_partitions,
        "partitioner": partitioner,
        "params": p,
        "num_train": int(len(train)),
        "num_test": int(len(test)),
    }
    return ClientShard(b.split(train), b.split(test), b.info, meta)


def load_server_data(
    dataset: str, partitioner: str, params: dict, seed: int, num_partitions: int, image_size: int | None = None
) -> ServerData:
    p, a, image_size = _resolve(dataset, partitioner, params, seed, num_partitions, image_size)
    b = load_base(dataset, image_size)
    parts = base_split(dataset, image_size)
    public = parts["public"]
    if a.public_exclude is not None:
        public = public[~np.isin(public, a.public_exclude)]
    meta = {**a.server_meta, "partitioner": partitioner, "params": p, "num_public": int(len(public)),
            "num_test": int(len(parts["test"]))}
    return ServerData(b.split(public), b.split(parts["test"]), b.info, meta)


def label_partitioner(dataset: str, partitioner: str, params: dict, seed: int, num_partitions: int,
                      image_size: int | None = None, test_fraction: float = 0.2):
    """Every client's shard (train + test rows, as load_client_shard draws them) as a flwr-datasets
    Partitioner over a `label` column, for flwr_datasets.metrics and flwr_datasets.visualization; its
    client_meta (client_domains) is what the partitioner decided about each client besides its rows."""
    from .assigned import AssignedPartitioner

    _, a, image_size = _resolve(dataset, partitioner, params, seed, num_partitions, image_size)
    b = load_base(dataset, image_size)
    rows = [np.concatenate(_shard_rows(a, b, seed, pid, test_fraction)) for pid in range(num_partitions)]
    return AssignedPartitioner.of_labels(b.y, b.info.class_names, rows, client_meta=a.client_meta)
