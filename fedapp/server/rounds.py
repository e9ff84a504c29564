"""The round-based methods' base: Flower's FedAvg round loop bound to one run, every train upload
through the validation gate before Flower aggregates it.

Used by FedAvg and its family (strategies/fedavg.py; fedprox, moon, feddifrc subclass it), fedavg-ddpm
and dpdm (strategies/ddpm_baselines.py) and fedflow (strategies/fedflow.py). Flower's loop owns the
rounds; a method names its train phase and overrides the hooks below.
"""

from __future__ import annotations

from typing import Any, Iterable

from flwr.app import ArrayRecord, Message, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedapp.protocols import ARRAYS_KEY, NUM_EXAMPLES_KEY, RUN_KEY, Phase
from fedapp.protocols.classify import validate_train
from fedapp.protocols.records import dtypes_of
from fedapp.server.run import ServerRun
from fedapp.server.strategy import FedappStrategy
from fedapp.server.validation import keep_valid

# where fedapp's records keep what Flower's FedAvg (and a robust aggregator built beside it) reads
RECORD_KEYS = dict(weighted_by_key=NUM_EXAMPLES_KEY, arrayrecord_key=ARRAYS_KEY, configrecord_key=RUN_KEY)


class RoundStrategy(FedappStrategy, FedAvg):
    """Flower's FedAvg on min-clients nodes. fraction_evaluate 0 (the default): no federated evaluate
    round (Flower then also needs no evaluate nodes); fraction_train 1: every node trains."""

    train_phase: Phase  # the protocol every train reply is checked against

    def __init__(self, run: ServerRun, fraction_train: float = 1.0, fraction_evaluate: float = 0.0, **kwargs: Any):
        n = run.cfg.min_clients
        super().__init__(min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n, fraction_train=fraction_train,
                         fraction_evaluate=fraction_evaluate or 1.0, **RECORD_KEYS, **kwargs)
        if fraction_evaluate == 0.0:  # set after Flower's __init__, which logs a WARNING for a 0 it is given:
            self.fraction_evaluate, self.min_evaluate_nodes = 0.0, 0  # here it is the protocol (what Flower does)
        self.bind(run)
        self._expected: dict[str, tuple] = {}  # the global model's keys -> shapes (`expect`)
        self._dtypes: dict[str, str] = {}  # and dtypes: an integer upload is never averaged into it

    def expect(self, initial: ArrayRecord) -> None:
        """Uploads must match this global model exactly (keys, shapes, dtypes): `validate_train`."""
        self._expected = {k: tuple(a.shape) for k, a in initial.items()}
        self._dtypes = dtypes_of(initial)

    def validate_train(self, content: RecordDict) -> str | None:
        """Why a train upload is unacceptable (default: FedAvg's, against `expect`'s model), or None."""
        return validate_train(content, self._expected, self.run.cfg.max_upload_bytes, self._dtypes)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        """The valid uploads only (the gate: fedapp.server.validation), then `aggregate_valid`."""
        return self.aggregate_valid(server_round, keep_valid(self.run, replies, self.train_phase, self.validate_train))

    def aggregate_valid(self, server_round: int, valid: list[Message]):
        """Flower's aggregation of the round's valid train replies (a method may combine them otherwise)."""
        return super().aggregate_train(server_round, valid)

    def run_rounds(self, grid, initial: ArrayRecord, num_rounds: int | None = None, **kwargs: Any):
        """Flower's round loop from `initial` for `num_rounds` (default num-server-rounds), the run config
        riding on every train message; kwargs go to Flower's `start` (evaluate_config, evaluate_fn)."""
        cfg = self.run.cfg
        return self.start(grid=grid, initial_arrays=initial,
                          num_rounds=cfg.num_server_rounds if num_rounds is None else num_rounds,
                          timeout=cfg.round_timeout, train_config=self.run_config_record(), **kwargs)
