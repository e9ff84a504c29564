"""What a client handler receives besides the message: its config, shard and state.

Handlers are plain functions `(message, ClientContext) -> RecordDict`; below them,
client code takes tensors and returns tensors, so it tests without a simulation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from fedapp.config import RunConfig


@dataclass
class ClientContext:
    cfg: RunConfig
    partition_id: int
    num_partitions: int
    state: Any = None  # Flower's Context.state (a RecordDict kept across rounds on this node)
    meta: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def device(self) -> str:
        return self.cfg.torch_device()

    @cached_property
    def shard(self):
        """This client's train/test split: a pure function of the config and partition id."""
        from feddata import load_client_shard

        cfg = self.cfg
        return load_client_shard(cfg.dataset, cfg.partitioner, cfg.partitioner_params, cfg.seed,
                                 self.partition_id, self.num_partitions, image_size=cfg.image_size)

    def seed_for(self, *salt: int) -> int:
        """A seed derived from the run seed, the partition id and a salt (e.g. the round)."""
        import zlib

        key = ",".join(str(s) for s in (self.cfg.seed, self.partition_id, *salt))
        return zlib.crc32(key.encode()) & 0x7FFFFFFF
