"""What a client handler receives besides the message: its config, shard and state.

Handlers are plain functions `(message, ClientContext) -> RecordDict`; below them,
client code takes tensors and returns tensors, so it tests without a simulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from fedapp.config import RunConfig


@dataclass
class ClientContext:
    cfg: RunConfig
    partition_id: int
    num_partitions: int
    state: Any = None  # Flower's Context.state (a RecordDict kept across rounds on this node)

    @cached_property
    def device(self) -> str:
        return self.cfg.torch_device()

    @cached_property
    def shard(self):
        """This client's train/test split: a pure function of the config and partition id."""
        from fedapp.data import client_shard

        return client_shard(self.cfg, self.partition_id, self.num_partitions)

    def seed_for(self, *salt: int) -> int:
        """A seed derived from the run seed, the partition id and a salt (e.g. the round)."""
        from fedapp.seeds import derive_seed

        return derive_seed(self.cfg.seed, self.partition_id, *salt)
