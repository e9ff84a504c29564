"""What the one-shot classification methods share (Espresso, its baselines, the centralized ceiling):
the global classifier trained on the server, and the evaluate phase in which every client tests it on
its real test split (fedapp/protocols/classify.py's EVALUATE)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from fedapp.data import classifier_split
from fedapp.metrics import accuracy_by_group, weighted_client_accuracy
from fedapp.protocols import ARRAYS_KEY
from fedapp.protocols import classify
from fedapp.protocols.records import partition_of
from fedapp.protocols.weights import weights_record
from fedapp.server import PhasedStrategy
from fedapp.server.checkpoint import save_model

log = logging.getLogger("fedapp")


def train_global_classifier(model: str, x: torch.Tensor, y: torch.Tensor, num_classes: int, *, epochs: int,
                            seed: int, device: str = "cpu") -> torch.nn.Module:
    """min_omega sum_k p_k E_{D'_k} L(omega): one classifier on the union of the (synthetic) sets
    (AdamW, cosine schedule; fedapp.models.classifier.train_classifier)."""
    from fedapp.models.classifier import build_classifier, train_classifier

    torch.manual_seed(seed)
    net = build_classifier(model, num_classes).to(device)
    return train_classifier(net, x, y, epochs=epochs, seed=seed, progress="server training epoch")


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def log_client_accuracies(acc: dict[int, dict[str, Any]], listed: int = 20) -> None:
    """Each client's accuracy, or with more than `listed` clients their min / median / max: one short line."""
    if len(acc) <= listed:
        log.info("per-client test accuracy: %s", {k: round(v["accuracy"], 4) for k, v in sorted(acc.items())})
        return
    vals = sorted(v["accuracy"] for v in acc.values())
    log.info("per-client test accuracy over %d clients: min %.4f, median %.4f, max %.4f", len(vals), vals[0],
             vals[len(vals) // 2], vals[-1])


class OneShotStrategy(PhasedStrategy):
    """A one-shot method: the method's own phases, then one evaluate phase."""

    def evaluate_classifier(self, grid, model: torch.nn.Module, server, nodes: list[int]) -> dict[str, Any]:
        """Global test accuracy (per domain) on the server, and each client's of `nodes` on its real test split
        (no nodes: the server's figures only)."""
        model = model.eval()
        save_model(self.run.out, model.state_dict())
        test = classifier_split(server.test, self.run.cfg)  # at classifier-size
        metrics = accuracy_by_group(model, test, server.info, device=self.run.device)
        if nodes:
            weights = weights_record(model.state_dict())  # packed, as FedAvg's evaluate sends it
            replies = self.exchange(grid, classify.EVALUATE, nodes, lambda n: {ARRAYS_KEY: weights},
                                    validate=classify.validate_evaluate)
            acc = classify.client_accuracies(replies)
            log_client_accuracies(acc)
            metrics.update(weighted_client_accuracy(acc))
            metrics["client_domain"] = {str(k): v["domain"] for k, v in sorted(acc.items())
                                        if v["domain"] is not None}
            # which clients evaluated, those with an empty test split (no accuracy) included
            metrics["evaluated_partitions"] = sorted(p for r in replies if (p := partition_of(r)) is not None)
        metrics["evaluated_clients"] = len(nodes)
        metrics["classifier_bytes"] = parameter_bytes(model)
        metrics["model"] = self.run.cfg.model
        log.info("global test accuracy %.4f %s", metrics["accuracy"], metrics.get("domain_accuracy", ""))
        return metrics
