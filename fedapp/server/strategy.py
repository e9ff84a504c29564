"""The two shapes a method's server side takes.

- Round-based methods (FedAvg, FedProx, MOON, FedDifRC, fedavg-ddpm, dpdm, FedFlow) subclass
  `RoundStrategy` (fedapp/server/rounds.py: Flower's `FedAvg` with `FedappStrategy` mixed in): Flower's
  loop owns the rounds, the method overrides hooks.
- Phased methods (Espresso, PFDM, DCFM and their one-shot baselines) subclass `PhasedStrategy`:
  `execute` reads as the protocol, one `exchange` per declared `Phase`, with the server's own work
  (synthesis, distillation, denoiser training) between them.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from flwr.app import Message, RecordDict

from fedapp.protocols import RUN_KEY, Phase
from fedapp.protocols.records import run_config_record
from fedapp.server.grid import make_messages
from fedapp.server.run import ServerRun
from fedapp.server.validation import Validator, keep_valid

log = logging.getLogger("fedapp")


class FedappStrategy:
    """Mixin: a method's whole server side, bound to one run. `execute(grid)` returns the final
    metrics for summary.json; `privacy`, when set, goes to summary.json's privacy block."""

    privacy: dict[str, Any] | None = None
    run: ServerRun[Any]  # a method's strategy narrows it: `run: ServerRun[ItsOptions]`

    def bind(self, run: ServerRun[Any]) -> None:
        self.run = run

    def run_config_record(self, **extra: Any):
        return run_config_record(self.run.cfg.flat(), **extra)

    def server_data(self, num_partitions: int | None = None):
        from fedapp.data import server_data

        if getattr(self, "_server_data", None) is None:
            self._server_data = server_data(self.run.cfg, num_partitions or self.run.cfg.min_clients)
        return self._server_data

    def execute(self, grid) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError


class PhasedStrategy(FedappStrategy):
    """A method that is a sequence of declared phases rather than a loop of FedAvg rounds."""

    def __init__(self, run: ServerRun):
        self.bind(run)

    def exchange(self, grid, phase: Phase, nodes: list[int],
                 records_for: Callable[[int], Mapping[str, Any]] | None = None,
                 validate: Validator | None = None, config: Any = None) -> list[Message]:
        """Send `phase` to `nodes` (the run config plus `records_for(node)`, a subset of
        `phase.down`) and return the replies; with `validate`, only the valid ones (keep_valid)."""
        conf = config if config is not None else self.run_config_record()

        def content(node: int) -> RecordDict:
            records = dict(records_for(node)) if records_for is not None else {}
            unknown = {k for k in records if not phase.allows_down(k)}
            if unknown:  # a programming error in the strategy, not a client's fault
                raise ValueError(f"phase {phase.name}: records {sorted(unknown)} are not in its protocol")
            return RecordDict({RUN_KEY: conf, **records})

        log.info("[%s] to %d clients", phase.message_type, len(nodes))  # the grid logs the replies
        replies = grid.send_and_receive(make_messages(nodes, phase.message_type, content),
                                        timeout=self.run.cfg.round_timeout)
        return replies if validate is None else keep_valid(self.run, replies, phase, validate)
