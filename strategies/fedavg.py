"""FedAvg (McMahan et al., 2017) on Flower's own FedAvg round loop.

Protocol: fedapp/protocols/classify.py (train: weights down, weights + num-examples up; evaluate:
weights down, accuracy up), the weights packed as one float32 Array (fedapp/protocols/weights.py).
What fedapp adds to Flower's loop: every upload passes the validation gate against the global model's
packed length and dtype before Flower aggregates it, bytes are metered by the grid, the global test set
is evaluated after every round, and each client's test accuracy is kept for the summary.

`aggregation` (run config) picks Flower's aggregation of the valid uploads: `mean` (FedAvg's
num-examples-weighted mean), `median` (FedMedian: coordinate-wise median), `trimmed-mean`
(FedTrimmedAvg, Flower's beta = 0.2: that fraction cut at each end per coordinate, then the plain mean)
or `krum` (Krum, Flower's num_malicious_nodes = 0: the one upload closest to its n - 2 nearest
neighbours, by distances over the whole upload). Each works coordinate by coordinate or on the whole
upload, so the packed layout gives what per-tensor arrays would (tests/test_weights.py). Every
FedAvg-family method (fedavg, fedprox, moon, feddifrc) inherits it.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Iterable

import torch
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedMedian, FedTrimmedAvg, Krum

from fedapp.data import classifier_split
from fedapp.metrics import accuracy_by_group, weighted_client_accuracy
from fedapp.models.classifier import build_classifier
from fedapp.progress import Rounds
from fedapp.protocols import ACCURACY_KEY, NUM_EXAMPLES_KEY
from fedapp.protocols import classify as P
from fedapp.protocols.weights import load_weights, weights_record
from fedapp.seeds import derive_seed
from fedapp.server import RoundStrategy, ServerRun, keep_valid
from fedapp.server.checkpoint import save_checkpoint, save_model
from fedapp.server.rounds import RECORD_KEYS

log = logging.getLogger("fedapp")


# `aggregation` -> the Flower strategy whose aggregate_train combines the valid uploads (None: FedAvg's own)
AGGREGATORS = {"mean": None, "median": FedMedian, "trimmed-mean": FedTrimmedAvg, "krum": Krum}


class FedAvgStrategy(RoundStrategy):
    train_phase = P.TRAIN  # a method whose clients report more train metrics declares its own

    def __init__(self, run: ServerRun, **kwargs: Any):
        # fraction-evaluate 0: no federated evaluation (Flower skips it)
        super().__init__(run, fraction_train=run.cfg.fraction_train, fraction_evaluate=run.cfg.fraction_evaluate,
                         **kwargs)
        robust = AGGREGATORS[run.cfg.aggregation]
        self.aggregator = robust(**RECORD_KEYS) if robust is not None else None
        self._client_acc: dict[int, dict[str, Any]] = {}
        self.round_offset = 0  # rounds a resumed run already has: Flower's loop counts from 1 again
        self.rounds = Rounds(run.cfg.num_server_rounds)  # the operator's round lines with an ETA

    # -- Flower hooks (rounds are the run's: Flower's + round_offset) -------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config, grid):
        messages = self._seeded("fraction-train", super().configure_train, server_round, arrays, config, grid)
        self.rounds.start(server_round + self.round_offset,
                          f"train on {len(messages)} of {len(grid.get_node_ids())} clients")
        return messages

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config, grid):
        run_round, cfg = server_round + self.round_offset, self.run.cfg
        if run_round % cfg.evaluate_every and run_round != cfg.num_server_rounds:  # evaluate-every: not this round
            return []
        return self._seeded("fraction-evaluate", super().configure_evaluate, server_round, arrays, config, grid)

    def _seeded(self, key: str, configure, server_round: int, *args) -> list[Message]:
        # Flower samples the round's nodes with the `random` module over grid.get_node_ids(): seeding it per
        # round makes the sample reproducible wherever node ids are (in-process runs, fixed deployments)
        state = random.getstate()
        random.seed(derive_seed(key, self.run.cfg.seed, server_round + self.round_offset))
        try:
            return list(configure(server_round + self.round_offset, *args))
        finally:
            random.setstate(state)

    def aggregate_valid(self, server_round: int, valid: list[Message]):
        """The round's valid uploads, aggregated as `aggregation` says."""
        if self.aggregator is not None:
            return self.aggregator.aggregate_train(server_round, valid)
        return super().aggregate_valid(server_round, valid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        if not replies and self.fraction_evaluate == 0:  # fraction-evaluate = 0: nobody was asked
            return None
        if not replies:  # a round evaluate-every skips: no client accuracy is carried into its row
            self._client_acc = {}
            return None
        replies = keep_valid(self.run, replies, P.EVALUATE, P.validate_evaluate)
        # a client with an empty test split (validation allows 0 only then) weighs nothing: Flower's
        # weighted mean would divide by zero if every reply were one
        replies = [r for r in replies if r.content.metric_records[P.METRICS_KEY][NUM_EXAMPLES_KEY] > 0]
        self._client_acc = P.client_accuracies(replies)
        return super().aggregate_evaluate(server_round, replies) if replies else None

    # -- fedapp -------------------------------------------------------------------------
    def build_model(self) -> torch.nn.Module:
        """The global model (methods with a projection head override this)."""
        return build_classifier(self.run.cfg.model, self.server_data().info.num_classes)

    def global_evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Global test accuracy after each round (Flower's evaluate_fn); checkpoints the model."""
        server_round += self.round_offset
        server = self.server_data()
        model = load_weights(self.build_model(), arrays)
        test = classifier_split(server.test, self.run.cfg)  # at classifier-size
        metrics = accuracy_by_group(model, test, server.info, device=self.run.device)
        if self.round_offset and server_round == self.round_offset:  # the resumed model: logged already
            return MetricRecord({ACCURACY_KEY: metrics["accuracy"]})
        row: dict[str, Any] = {"round": server_round, **metrics}
        if self._client_acc and server_round > 0:
            row.update(weighted_client_accuracy(self._client_acc))
        self.run.out.log_metrics(row)
        if server_round > 0:
            save_checkpoint(self.run.out, server_round, model.state_dict(), self.run.progress())
        log.info("[round %d] global test accuracy %.4f", server_round, metrics["accuracy"])
        if server_round > 0:  # global_evaluate is the last step of Flower's round
            self.rounds.end(server_round)
        return MetricRecord({ACCURACY_KEY: metrics["accuracy"]})

    def execute(self, grid) -> dict[str, Any]:
        cfg = self.run.cfg
        torch.manual_seed(cfg.seed)
        model = self.build_model()
        if self.run.resume_from is not None:  # continue after the checkpoint's round
            model.load_state_dict(self.run.resume_from.state)
            self.round_offset = self.run.resume_from.round
            self.rounds.first = self.round_offset + 1
        initial = weights_record(model.state_dict())
        self.expect(initial)  # the packed record: one float32 array of the model's length
        result = self.run_rounds(grid, initial, cfg.num_server_rounds - self.round_offset,
                                 evaluate_config=self.run_config_record(), evaluate_fn=self.global_evaluate)
        save_model(self.run.out, load_weights(model, result.arrays).state_dict())
        last = self.run.out.metrics[-1]
        self.run.out.plot_accuracy()
        return {k: v for k, v in last.items() if k != "round"}

