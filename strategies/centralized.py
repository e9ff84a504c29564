"""`centralized`: the ceiling of the one-shot methods -- a classifier trained on the union of the
clients' real training data.

ORACLE, NOT A FEDERATED PROTOCOL: the server derives every client's shard itself
(fedapp.data.all_client_shards; possible only because a shard is a pure function of the config and
the partition id). No client uploads anything; it is the "Ceiling" row of Espresso's tables. The
classifier, its training (`server-epochs`) and the evaluation (global test set per domain, plus each
client's real test split through the evaluate phase) are Espresso's, so the numbers compare.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fedapp.data import all_client_shards, for_classifier
from strategies.oneshot import OneShotStrategy, train_global_classifier

log = logging.getLogger("fedapp")


def union_of_client_shards(cfg, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ORACLE: every client's real training split, concatenated (x, y)."""
    shards = all_client_shards(cfg, num_partitions)
    return torch.cat([for_classifier(s.train.x, cfg) for s in shards]), torch.cat([s.train.y for s in shards])


class CentralizedStrategy(OneShotStrategy):
    def execute(self, grid) -> dict[str, Any]:
        cfg, run = self.run.cfg, self.run
        nodes = sorted(grid.get_node_ids())
        server = self.server_data(len(nodes))
        log.warning("centralized: an ORACLE ceiling; the server reads all %d clients' real data", len(nodes))
        x, y = union_of_client_shards(cfg, len(nodes))
        with run.phase("classifier", f"{cfg.server_epochs} epochs on {len(x)} real images"):
            model = train_global_classifier(cfg.model, x, y, server.info.num_classes, epochs=cfg.server_epochs,
                                            seed=cfg.seed, device=run.device)
        metrics = self.evaluate_classifier(grid, model, server, nodes)
        metrics.update({"oracle": True, "num_train": len(x)})
        run.out.log_metrics({"phase": "final", **metrics})
        return metrics
