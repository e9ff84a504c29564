"""FedAvg (McMahan et al., 2017) on Flower's own FedAvg round loop.

What fedapp adds: uploads are validated against the global model's keys and shapes
(non-finite or mis-shaped ones are dropped with a reason), bytes are metered by the grid,
the global test set is evaluated after every round, and each client's test accuracy
is kept for the summary. Aggregation is Flower's sample-weighted average.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from fedapp.models.classifier import build_classifier
from fedapp.metrics import accuracy_by_group
from strategies.base import CLIENT_KEY, FedappStrategy, ServerRun, check_arrays, keep_valid

log = logging.getLogger("fedapp")


class FedAvgStrategy(FedappStrategy, FedAvg):
    def __init__(self, run: ServerRun, **kwargs: Any):
        n = run.cfg.min_clients
        super().__init__(min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n, **kwargs)
        self.bind(run)
        self._server = None
        self._expected: dict[str, tuple] = {}
        self._client_acc: dict[int, dict[str, Any]] = {}

    # -- Flower hooks -------------------------------------------------------------------
    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        max_bytes = self.run.cfg.max_upload_mb * 2**20
        valid = keep_valid(self.run, replies, "train", lambda c: check_arrays(
            c.array_records.get("arrays"), self._expected, max_bytes))
        return super().aggregate_train(server_round, valid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]):
        replies = [r for r in replies if not r.has_error()]
        self._client_acc = {}
        for r in replies:
            client = r.content.config_records.get(CLIENT_KEY, {})
            m = r.content.metric_records["metrics"]
            self._client_acc[int(client.get("partition-id", -1))] = {
                "accuracy": float(m["accuracy"]), "n": int(m["num-examples"]),
                "domain": client.get("domain")}
        return super().aggregate_evaluate(server_round, replies)

    # -- fedapp -------------------------------------------------------------------------
    def server_data(self):
        if self._server is None:
            from feddata import load_server_data

            cfg = self.run.cfg
            self._server = load_server_data(cfg.dataset, cfg.partitioner, cfg.partitioner_params,
                                            cfg.seed, max(cfg.min_clients, 1), image_size=cfg.image_size)
        return self._server

    def build_model(self) -> torch.nn.Module:
        """The global model (methods with a projection head override this)."""
        return build_classifier(self.run.cfg.model, self.server_data().info.num_classes)

    def global_evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        server = self.server_data()
        model = self.build_model()
        model.load_state_dict(arrays.to_torch_state_dict())
        metrics = accuracy_by_group(model, server.test, server.info, device=self.run.device)
        row: dict[str, Any] = {"round": server_round, **metrics}
        if self._client_acc and server_round > 0:
            n = sum(v["n"] for v in self._client_acc.values())
            row["client_accuracy"] = sum(v["accuracy"] * v["n"] for v in self._client_acc.values()) / max(n, 1)
            row["per_client_accuracy"] = {str(k): v["accuracy"] for k, v in sorted(self._client_acc.items())}
        self.run.out.log_metrics(row)
        log.info("[round %d] global test accuracy %.4f", server_round, metrics["accuracy"])
        return MetricRecord({"accuracy": metrics["accuracy"]})

    def execute(self, grid) -> dict[str, Any]:
        cfg = self.run.cfg
        torch.manual_seed(cfg.seed)
        model = self.build_model()
        initial = ArrayRecord(model.state_dict())
        self._expected = {k: tuple(a.shape) for k, a in initial.items()}
        self.start(grid=grid, initial_arrays=initial, num_rounds=cfg.num_server_rounds,
                   timeout=cfg.round_timeout, train_config=self.run_config_record(),
                   evaluate_config=self.run_config_record(), evaluate_fn=self.global_evaluate)
        last = self.run.out.metrics[-1]
        self.run.out.plot_accuracy()
        return {k: v for k, v in last.items() if k != "round"}
