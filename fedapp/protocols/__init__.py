"""Message protocols: the one place a record key is spelled.

Every method has a module here that both its server side (strategies/<m>.py) and its client side
(clients/<m>.py) import: its options dataclass, its phases (message type, the records that go down
and come up), its record keys, its upload schema and validation. This module holds what every
protocol shares: the records every message carries and the `Phase` declaration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
from flwr.app import RecordDict

RUN_KEY = "config"  # ConfigRecord on every message down: the resolved flat run config
CLIENT_KEY = "client"  # ConfigRecord on every reply: who answered (partition-id, domain)
METRICS_KEY = "metrics"  # MetricRecord on a reply
ARRAYS_KEY = "arrays"  # ArrayRecord of model weights (Flower's FedAvg reads and writes this name)

# Keys of RUN_KEY's ConfigRecord that Flower's own strategies add beside the run config.
ROUND_KEY = "server-round"
PROXIMAL_MU_KEY = "proximal-mu"
FLOWER_CONFIG_KEYS = (ROUND_KEY, PROXIMAL_MU_KEY)

# Keys of CLIENT_KEY's ConfigRecord and of METRICS_KEY's MetricRecord every method uses.
PARTITION_KEY = "partition-id"
NUM_PARTITIONS_KEY = "num-partitions"  # how many partitions the node split the data into (its --node-config)
DOMAIN_KEY = "domain"
SECONDS_KEY = "seconds"  # the client's own wall time on the message it answers (its compute, for the ledger)
NUM_EXAMPLES_KEY = "num-examples"  # Flower's FedAvg weights uploads by this metric


@dataclass(frozen=True)
class ShardFacts:
    """What the server knows of a partition's data without asking its client: a shard is a pure
    function of the run config and the partition id (fedapp.data.client_shard), so its sizes, labels
    and attributes are the server's own and bound what a client may claim to hold."""

    partition: int
    num_train: int
    num_test: int
    num_classes: int
    labels: np.ndarray  # (num_train,) int64: the training labels
    attrs: Mapping[str, np.ndarray] = field(default_factory=dict)  # training attributes, each (num_train,)
    attr_sizes: Mapping[str, int] = field(default_factory=dict)  # values per attribute

    def class_counts(self) -> np.ndarray:
        return np.bincount(self.labels, minlength=self.num_classes)

    def examples(self, split: str) -> int:
        return self.num_test if split == "test" else self.num_train


# A phase's check of an upload against the shard its client serves: why it claims more than the
# shard holds, or None. Runs after the record, metric and num-examples checks.
ShardBound = Callable[[RecordDict, ShardFacts], "str | None"]


@dataclass(frozen=True)
class Phase:
    """One exchange of a protocol: a message type, the records that go down (besides RUN_KEY) and
    the records a valid reply carries (besides CLIENT_KEY).

    What the validation gate (fedapp.server.validation.keep_valid) checks besides: `metrics`, the
    exact keys of the reply's METRICS_KEY record where the phase fixes them (every value must be a
    finite number in any case); `examples`, the split of the client's shard that bounds its
    NUM_EXAMPLES_KEY; `bound`, the phase's own check of the upload against that shard."""

    message_type: str  # Flower message type: "train", "evaluate" or "query.<name>"
    down: tuple[str, ...]
    up: tuple[str, ...]
    doc: str = ""
    metrics: tuple[str, ...] | None = None
    examples: str = "train"  # "train" | "test"
    bound: ShardBound | None = None

    @property
    def name(self) -> str:
        return self.message_type

    def allows_down(self, key: str) -> bool:
        """`down` lists record names; an entry ending in "." is a prefix ("peer." for "peer.3")."""
        return any(key == d or (d.endswith(".") and key.startswith(d)) for d in self.down)


# The evaluate exchange of every classification method: the global model down, accuracy up.
LOSS_KEY, ACCURACY_KEY = "loss", "accuracy"  # evaluate metrics, besides NUM_EXAMPLES_KEY
EVAL_METRICS = (LOSS_KEY, ACCURACY_KEY)
EVALUATE = Phase("evaluate", down=(ARRAYS_KEY,), up=(METRICS_KEY,),
                 doc="clients test the server's classifier on their real test split",
                 metrics=(NUM_EXAMPLES_KEY, *EVAL_METRICS), examples="test")
