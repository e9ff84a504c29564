"""A run config's data: the server's public/test split and each client's shard.

A shard is a pure function of (dataset, partitioner, its parameters, seed, partition id, number of
partitions), so a simulated client, a SuperNode on another machine and the server's evaluation
oracles all derive the same images from the config alone.
"""

from __future__ import annotations

from typing import Any


def server_data(cfg: Any, num_partitions: int):
    """The server's split: public images (priors, reference classifiers) and the global test set."""
    from feddata import load_server_data

    return load_server_data(cfg.dataset, cfg.partitioner, cfg.partitioner_params, cfg.seed,
                            max(num_partitions, 1), image_size=cfg.image_size)


def client_shard(cfg: Any, partition_id: int, num_partitions: int):
    """One client's train/test split."""
    from feddata import load_client_shard

    return load_client_shard(cfg.dataset, cfg.partitioner, cfg.partitioner_params, cfg.seed, partition_id,
                             num_partitions, image_size=cfg.image_size)


def for_classifier(x, cfg: Any):
    """Images x at the classifier's input size (classifier-size): a hub dataset's or folder's split decoded
    straight at it, a tensor resized; x itself when it already is (classifier-size auto)."""
    from feddata import at_size

    return at_size(x, cfg.classifier_size)


def classifier_split(split, cfg: Any):
    """`split` with its images at the classifier's input size (for_classifier)."""
    import dataclasses

    return dataclasses.replace(split, x=for_classifier(split.x, cfg))


def all_client_shards(cfg: Any, num_partitions: int) -> list:
    """ORACLE: every client's shard re-derived on the server. Only oracle baselines and the scoring of
    attacks against the truth use it; no federated protocol does."""
    return [client_shard(cfg, pid, num_partitions) for pid in range(num_partitions)]


def label_partitioner(cfg: Any, num_partitions: int):
    """Every client's labels as a flwr-datasets Partitioner, for the run's label-distribution plot. The
    server derives it from the config as it derives its own split (a shard is a pure function of the
    config, see above): no client reports its labels for it."""
    from feddata import label_partitioner as of_config

    return of_config(cfg.dataset, cfg.partitioner, cfg.partitioner_params, cfg.seed, num_partitions,
                     image_size=cfg.image_size)
