"""What a client handler receives besides the message: its config, shard and state.

Handlers are plain functions `(message, ClientContext) -> RecordDict`; below them,
client code takes tensors and returns tensors, so it tests without a simulation.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Generic

from fedapp.config import Opts, RunConfig, ray_gpu_ids

log = logging.getLogger("fedapp")
_DEVICE_LOGGED: set[int] = set()  # partitions whose device this process has logged


@dataclass
class ClientContext(Generic[Opts]):
    """`Opts`: the method's options class (a handler annotates `ClientContext[ItsOptions]` and reads
    `ctx.cfg.options` typed)."""

    cfg: RunConfig[Opts]
    partition_id: int
    num_partitions: int
    state: Any = None  # Flower's Context.state (a RecordDict kept across rounds on this node)

    @cached_property
    def device(self) -> str:
        device = self.cfg.torch_device()
        _log_device_once(self.partition_id, self.cfg.device, device)
        return device

    @cached_property
    def shard(self):
        """This client's train/test split: a pure function of the config and partition id, kept on the node's
        disk for the next message's process (fedapp.shard_cache)."""
        from fedapp.shard_cache import client_shard

        return client_shard(self.cfg, self.partition_id, self.num_partitions)

    def seed_for(self, *salt: int) -> int:
        """A seed derived from the run seed, the partition id and a salt (e.g. the round)."""
        from fedapp.seeds import derive_seed

        return derive_seed(self.cfg.seed, self.partition_id, *salt)


def _log_device_once(partition_id: int, asked: str, device: str) -> None:
    """One line per client and process: the device it runs on and why (what Ray assigned it, what
    CUDA_VISIBLE_DEVICES shows); a WARNING where Ray gave it a GPU that torch cannot use."""
    if partition_id in _DEVICE_LOGGED:
        return
    _DEVICE_LOGGED.add(partition_id)
    gpus = ray_gpu_ids()
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if asked == "auto" and gpus and device == "cpu":
        log.warning("client %d: device=auto, Ray assigned GPU %s (CUDA_VISIBLE_DEVICES=%s) but torch finds no "
                    "CUDA device: running on cpu", partition_id, ",".join(map(str, gpus)), seen)
    else:
        log.info("client %d: device %s (device=%s, Ray GPUs %s, CUDA_VISIBLE_DEVICES=%s)", partition_id, device,
                 asked, "none" if gpus is None else (",".join(map(str, gpus)) or "[]"), seen)
