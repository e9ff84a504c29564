"""A fixed assignment of rows to clients in flwr-datasets' Partitioner interface, so that its metrics
(`compute_counts`) and visualisation (`plot_label_distributions`) work on every feddata partitioner,
including the ones flwr-datasets does not have (domain, attribute-holdout, minority)."""

from __future__ import annotations

import numpy as np
from datasets import ClassLabel, Dataset, Features
from flwr_datasets.partitioner import Partitioner


class AssignedPartitioner(Partitioner):
    """Partition k = the dataset's rows `rows[k]`; `client_meta[k]`: what the partitioner says about client k
    beyond its rows (the `domain` partitioner: its domain), empty dicts when nothing."""

    def __init__(self, rows: list[np.ndarray], client_meta: list[dict] | None = None):
        super().__init__()
        self._rows = [np.asarray(r, dtype=np.int64) for r in rows]
        self.client_meta = [dict(m) for m in client_meta] if client_meta is not None else [{} for _ in rows]
        if len(self.client_meta) != len(self._rows):
            raise ValueError(f"client_meta has {len(self.client_meta)} entries for {len(self._rows)} partitions")

    @property
    def client_domains(self) -> list[str | None]:
        """Each client's domain (a str) where the partitioner gave it one, else None."""
        return [m.get("domain") if isinstance(m.get("domain"), str) else None for m in self.client_meta]

    @classmethod
    def of_labels(cls, labels: np.ndarray, class_names: list[str], rows: list[np.ndarray],
                  client_meta: list[dict] | None = None) -> "AssignedPartitioner":
        """Over a one-column table of `labels`, typed as ClassLabel so that plots name the classes."""
        part = cls(rows, client_meta)
        features = Features({"label": ClassLabel(names=list(class_names))})
        part.dataset = Dataset.from_dict({"label": np.asarray(labels).tolist()}, features=features)
        return part

    @property
    def num_partitions(self) -> int:
        return len(self._rows)

    def load_partition(self, partition_id: int) -> Dataset:
        return self.dataset.select(self._rows[partition_id])
