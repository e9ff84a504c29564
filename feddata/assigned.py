"""A fixed assignment of rows to clients in flwr-datasets' Partitioner interface, so that its metrics
(`compute_counts`) and visualisation (`plot_label_distributions`) work on every feddata partitioner,
including the ones flwr-datasets does not have (domain, attribute-holdout, minority)."""

from __future__ import annotations

import numpy as np
from datasets import ClassLabel, Dataset, Features
from flwr_datasets.partitioner import Partitioner


class AssignedPartitioner(Partitioner):
    """Partition k = the dataset's rows `rows[k]`."""

    def __init__(self, rows: list[np.ndarray]):
        super().__init__()
        self._rows = [np.asarray(r, dtype=np.int64) for r in rows]

    @classmethod
    def of_labels(cls, labels: np.ndarray, class_names: list[str], rows: list[np.ndarray]) -> "AssignedPartitioner":
        """Over a one-column table of `labels`, typed as ClassLabel so that plots name the classes."""
        part = cls(rows)
        features = Features({"label": ClassLabel(names=list(class_names))})
        part.dataset = Dataset.from_dict({"label": np.asarray(labels).tolist()}, features=features)
        return part

    @property
    def num_partitions(self) -> int:
        return len(self._rows)

    def load_partition(self, partition_id: int) -> Dataset:
        return self.dataset.select(self._rows[partition_id])
