"""Flower's Grid, metered: every message down and reply up is counted per client and phase, and
every failed or missing reply recorded, whether Flower's round loop or a method's phase sends it."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from flwr.app import Message, RecordDict

from fedapp.protocols.records import partition_of, record_nbytes
from fedapp.server.run import ServerRun

log = logging.getLogger("fedapp")


class MeteredGrid:
    """A Grid proxy that counts bytes per client and phase and records failed replies."""

    def __init__(self, grid: Any, run: ServerRun):
        self._grid = grid
        self.run = run

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        if not messages:
            return []
        phase = messages[0].metadata.message_type
        for m in messages:
            self.run.ledger.add(str(m.metadata.dst_node_id), phase, "down", record_nbytes(m.content))
        t0 = time.time()
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        self.run.add_seconds(phase, time.time() - t0)
        answered = set()
        for r in replies:
            node = r.metadata.src_node_id
            answered.add(node)
            if r.has_error():
                self.run.fail(node, phase, f"client error: {r.error.reason}")
                continue
            pid = partition_of(r)
            if pid is not None:
                self.run.node_partition[node] = pid
            self.run.ledger.add(str(node), phase, "up", record_nbytes(r.content))
        for m in messages:
            if m.metadata.dst_node_id not in answered:
                self.run.fail(m.metadata.dst_node_id, phase, f"no reply within {timeout} s")
        ok = sum(not r.has_error() for r in replies)
        log.info("[%s] %d/%d clients replied in %.1fs", phase, ok, len(messages), time.time() - t0)
        return replies


def make_messages(node_ids: Iterable[int], message_type: str,
                  content_for: Callable[[int], RecordDict]) -> list[Message]:
    """One message per node (contents may differ per node)."""
    return [Message(content=content_for(n), message_type=message_type, dst_node_id=n) for n in node_ids]


def wait_for_nodes(grid: Any, n: int, timeout: float = 600.0, poll: float = 1.0) -> list[int]:
    """Block until at least `n` nodes are connected (deployment nodes join over time)."""
    t0 = time.time()
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= n:
            return nodes
        if time.time() - t0 > timeout:
            raise RuntimeError(f"min-clients={n}: only {len(nodes)} nodes connected within node-timeout="
                               f"{timeout:g} s")
        time.sleep(poll)
