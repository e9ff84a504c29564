"""What every strategy shares on the server: waiting for nodes, byte accounting, failure
tolerance and payload validation.

`MeteredGrid` wraps Flower's Grid, so Flower's own round loop (`FedAvg.start`) and a method's
hand-written phases both count bytes and record failures in one place. `check_arrays` is the
single upload validator: a bad upload is dropped with a logged reason, never aggregated.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedapp.config import RunConfig
from fedapp.results import CommLedger, RunDir

log = logging.getLogger("fedapp")

RUN_KEY = "config"  # the ConfigRecord every message carries: the resolved flat run config
CLIENT_KEY = "client"  # the ConfigRecord every reply carries: who answered


def record_nbytes(content: RecordDict) -> int:
    """Payload bytes of a RecordDict: tensors by their buffers, config/metrics by value."""
    total = 0
    for rec in content.values():
        if isinstance(rec, ArrayRecord):
            total += sum(len(a.data) for a in rec.values())
        elif isinstance(rec, (ConfigRecord, MetricRecord)):
            for k, v in rec.items():
                total += len(k)
                vals = v if isinstance(v, list) else [v]
                for x in vals:
                    total += len(x) if isinstance(x, (bytes, str)) else 8
    return total


def check_arrays(record: ArrayRecord | None, expected: Mapping[str, tuple] | None = None,
                 max_bytes: float | None = None) -> str | None:
    """Return why an uploaded ArrayRecord is unacceptable, or None if it is fine.

    `expected` maps key -> shape (None in a shape matches any size); keys must match exactly.
    """
    if record is None:
        return "no arrays in the upload"
    if expected is not None:
        if set(record.keys()) != set(expected):
            missing = sorted(set(expected) - set(record.keys()))[:3]
            extra = sorted(set(record.keys()) - set(expected))[:3]
            return f"wrong keys (missing {missing}, unexpected {extra})"
    size = 0
    for key, arr in record.items():
        a = arr.numpy()
        size += a.nbytes
        if expected is not None:
            shape = expected[key]
            if len(shape) != a.ndim or any(s is not None and s != d for s, d in zip(shape, a.shape)):
                return f"{key}: shape {tuple(a.shape)} != expected {tuple(shape)}"
        if a.dtype.kind not in "fiub":
            return f"{key}: dtype {a.dtype} is not numeric"
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            return f"{key}: non-finite values"
    if max_bytes is not None and size > max_bytes:
        return f"upload of {size} bytes exceeds the cap of {int(max_bytes)} bytes"
    return None


@dataclass
class ServerRun:
    """Per-run server state every strategy writes into."""

    cfg: RunConfig
    out: RunDir
    ledger: CommLedger = field(default_factory=CommLedger)
    failures: list[dict[str, Any]] = field(default_factory=list)
    node_partition: dict[int, int] = field(default_factory=dict)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    device: str = "cpu"

    def fail(self, node_id: int, phase: str, reason: str) -> None:
        pid = self.node_partition.get(node_id)
        who = f"client {pid}" if pid is not None else f"node {node_id}"
        log.warning("[%s] dropped %s: %s", phase, who, reason)
        self.failures.append({"node_id": node_id, "partition_id": pid, "phase": phase,
                              "reason": reason})

    def client_label(self, node_id: int) -> str:
        pid = self.node_partition.get(node_id)
        return str(pid) if pid is not None else f"node-{node_id}"

    def comm(self) -> dict[str, Any]:
        totals = self.ledger.totals()
        # The ledger is keyed by node id; report partition ids once they are known.
        per = {}
        for node, row in totals["per_client"].items():
            label = self.client_label(int(node)) if node.isdigit() else node
            per[label] = row
        totals["per_client"] = per
        return totals


def partition_of(reply: Message) -> int | None:
    rec = reply.content.config_records.get(CLIENT_KEY) if reply.has_content() else None
    return int(rec["partition-id"]) if rec and "partition-id" in rec else None


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
        self.run.phase_seconds[phase] = self.run.phase_seconds.get(phase, 0.0) + time.time() - t0
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


def wait_for_nodes(grid: Any, n: int, timeout: float = 600.0, poll: float = 1.0) -> list[int]:
    """Block until at least `n` nodes are connected (deployment nodes join over time)."""
    t0 = time.time()
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= n:
            return nodes
        if time.time() - t0 > timeout:
            raise RuntimeError(f"only {len(nodes)} of min-clients={n} nodes connected after {timeout:.0f} s")
        time.sleep(poll)


def keep_valid(run: ServerRun, replies: Iterable[Message], phase: str,
               validate: Callable[[RecordDict], str | None]) -> list[Message]:
    """Drop error replies and uploads `validate` rejects; enforce min-clients."""
    kept = []
    for r in replies:
        if r.has_error():
            continue  # already recorded by MeteredGrid
        reason = validate(r.content)
        if reason is not None:
            run.fail(r.metadata.src_node_id, phase, f"invalid upload: {reason}")
            continue
        kept.append(r)
    if len(kept) < run.cfg.min_clients:
        raise RuntimeError(f"[{phase}] only {len(kept)} valid replies, fewer than "
                           f"min-clients={run.cfg.min_clients}; see failures")
    return kept


def make_messages(grid: Any, node_ids: Iterable[int], message_type: str,
                  content_for: Callable[[int], RecordDict]) -> list[Message]:
    """One message per node (contents may differ per node)."""
    return [Message(content=content_for(n), message_type=message_type, dst_node_id=n)
            for n in node_ids]


class FedappStrategy:
    """Mixin: a strategy's whole server-side run. Subclasses implement `execute`."""

    def bind(self, run: ServerRun) -> None:
        self.run = run

    def run_config_record(self, **extra: Any) -> ConfigRecord:
        rec = ConfigRecord(dict(self.run.cfg.flat()))
        for k, v in extra.items():
            rec[k] = v
        return rec

    def execute(self, grid: MeteredGrid) -> dict[str, Any]:  # pragma: no cover - abstract
        """Run the method; return the final metrics for summary.json."""
        raise NotImplementedError
