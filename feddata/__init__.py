"""Data sources and partitioners for fedapp.

A client's shard is a pure function of (dataset, partitioner, params, seed, partition id,
number of partitions, image size); the server gets a public split and a global test set
disjoint from every client. Named `feddata`, not `datasets`, so as not to shadow Hugging
Face `datasets`, which flwr-datasets imports.
"""

from .api import label_partitioner, load_client_shard, load_server_data, validate
from .builtin import COLORS, DIGIT_NAMES, DOMAINS, with_attribute
from .lazy import LazyImages, at_size
from .partition import PARTITIONER_PARAMS, PARTITIONERS, resolve_params
from .sources import DATASETS, base_split, dataset_info, native_size
from .types import ClientShard, DatasetInfo, ServerData, Split

__all__ = [
    "COLORS",
    "DATASETS",
    "DIGIT_NAMES",
    "DOMAINS",
    "PARTITIONERS",
    "PARTITIONER_PARAMS",
    "ClientShard",
    "DatasetInfo",
    "LazyImages",
    "ServerData",
    "Split",
    "at_size",
    "base_split",
    "dataset_info",
    "label_partitioner",
    "load_client_shard",
    "load_server_data",
    "native_size",
    "resolve_params",
    "validate",
    "with_attribute",
]
