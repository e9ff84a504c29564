"""The state one run's server accumulates: config, run folder, byte ledger, failures, timings."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic

from fedapp.config import Opts, RunConfig
from fedapp.results import PHASE_SEP, CommLedger, RunDir

log = logging.getLogger("fedapp")


@dataclass
class ServerRun(Generic[Opts]):
    """Per-run server state every strategy writes into; `Opts`: the method's options class (a strategy
    annotates `ServerRun[ItsOptions]` and reads `run.cfg.options` typed)."""

    cfg: RunConfig[Opts]
    out: RunDir
    ledger: CommLedger = field(default_factory=CommLedger)
    failures: list[dict[str, Any]] = field(default_factory=list)
    node_partition: dict[int, int] = field(default_factory=dict)  # accepted claims (fedapp.server.grid)
    num_partitions: int | None = None  # nodes connected at the start: partition ids are 0 .. this - 1
    phase_seconds: dict[str, float] = field(default_factory=dict)  # a nested phase as `outer/inner` (PHASE_SEP)
    device: str = "cpu"
    kept_uploads: dict[tuple[str, int], int] = field(default_factory=dict)  # replies kept (fedapp.server.uploads)
    resume_from: Any = None  # a fedapp.server.checkpoint.Checkpoint when the run continues an earlier one
    started: float = field(default_factory=time.time)
    _open_phases: list[str] = field(default_factory=list, repr=False)  # the phases running now, outermost first

    def earlier(self) -> dict[str, Any]:
        """What the stopped run this one continues had spent (its checkpoint's progress); {} for a new run."""
        return self.resume_from.progress if self.resume_from is not None else {}

    def wall_seconds(self) -> float:
        return self.earlier().get("wall_seconds", 0.0) + time.time() - self.started

    def total_phase_seconds(self) -> dict[str, float]:
        out = dict(self.earlier().get("phase_seconds", {}))
        for k, v in self.phase_seconds.items():
            out[k] = out.get(k, 0.0) + v
        return out

    def progress(self) -> dict[str, Any]:
        """What the run has spent so far, the earlier run's included: kept with each checkpoint."""
        return {"per_client": self.comm()["per_client"], "phase_seconds": self.total_phase_seconds(),
                "wall_seconds": self.wall_seconds()}

    def fail(self, node_id: int, phase: str, reason: str) -> None:
        pid = self.node_partition.get(node_id)
        who = f"client {pid}" if pid is not None else f"node {node_id}"
        log.warning("[%s] dropped %s: %s", phase, who, reason)
        self.failures.append({"node_id": node_id, "partition_id": pid, "phase": phase, "reason": reason})

    @contextlib.contextmanager
    def phase(self, name: str, what: str = "", quiet: bool = False) -> Iterator[None]:
        """One server phase: a start line (`synthesis: 5000 images for 4 clients`), an end line
        (`synthesis done in 40.2 s`) and its wall time in summary.json's phase_seconds, summed over
        repeats (a message type recurs every round). quiet: the time only (the grid logs its own line).

        A phase run inside another is kept as `outer/inner` (Espresso's `ship-prior/query.prior`: the
        messages of the ship-prior phase), its time a part of the outer one's: the top-level phases'
        seconds add up to no more than the wall time (fedapp.results.phase_tree)."""
        if not quiet:
            log.info("%s: %s", name, what or "start")
        key = PHASE_SEP.join([*self._open_phases, name])
        self.phase_seconds.setdefault(key, 0.0)  # in start order: an outer phase before those inside it
        self._open_phases.append(name)
        t0 = time.time()
        try:
            yield
        finally:
            self._open_phases.pop()
            self.phase_seconds[key] += time.time() - t0
            if not quiet:
                log.info("%s done in %.1f s", name, time.time() - t0)

    def client_label(self, node_id: int) -> str:
        pid = self.node_partition.get(node_id)
        return str(pid) if pid is not None else f"node-{node_id}"

    def comm(self) -> dict[str, Any]:
        """Byte totals; the ledger is keyed by node id, reported by partition id once known."""
        totals = self.ledger.totals()
        per: dict[str, dict[str, float]] = {}
        for node, row in totals["per_client"].items():
            label = self.client_label(int(node)) if node.isdigit() else node
            if label in per:  # the same client under two node ids (it rejoined): merge, never overwrite
                row = {k: per[label][k] + v for k, v in row.items()}
            per[label] = row
        for label, row in self.earlier().get("per_client", {}).items():  # a resumed run's earlier part
            now = per.get(label, {})  # (a checkpoint from before compute_seconds lacks that key: union)
            per[label] = {k: now.get(k, 0) + row.get(k, 0) for k in now.keys() | row.keys()}
        totals["per_client"] = per
        totals["up_bytes"] = sum(r["up_bytes"] for r in per.values())
        totals["down_bytes"] = sum(r["down_bytes"] for r in per.values())
        totals["compute_seconds"] = sum(r.get("compute_seconds", 0.0) for r in per.values())
        return totals
