"""FedDifRC (Wang et al., ICCV 2025, arXiv 2507.06482): FedAvg whose clients add two regularisers
computed from a frozen text-to-image diffusion prior,

    L = L_CE + lambda_TDCL · L_TDCL + lambda_NDCR · L_NDCR        (clients/feddifrc.py)

The server side is FedAvg's (Flower's sample-weighted average, fedapp's upload validation); what
changes is the global model (with `feddifrc.feature-on = head` it carries a projection head g from the
embedding to the targets' dimension), and the summary, which reports what the
clients' representation caches cost.
"""

from __future__ import annotations

from typing import Any

from flwr.app import Message

from fedapp.protocols import METRICS_KEY
from fedapp.protocols import feddifrc as P
from fedapp.protocols.records import partition_of
from fedapp.server import ServerRun
from strategies.fedavg import FedAvgStrategy


class FedDifRCStrategy(FedAvgStrategy):
    train_phase = P.TRAIN  # FedAvg's, with the regulariser and cache metrics
    run: ServerRun[P.FedDifRCOptions]

    def __init__(self, run: ServerRun[P.FedDifRCOptions]):
        super().__init__(run)
        self._cache: dict[int, dict[str, float]] = {}

    def build_model(self):
        """The classifier whose embedding (or projection head g on it) TDCL/NDCR act on."""
        return P.feddifrc_classifier(self.run.cfg, self.server_data().info.num_classes)

    def build_prior(self) -> None:
        """A built-in tiny prior not built yet is built here, once, before any client needs it: the nodes of a
        simulation share this machine's cache and load it from there (deployed nodes build or copy their own)."""
        from fedapp.models.prior import ensure_prior_built

        cfg = self.run.cfg
        ensure_prior_built(cfg.prior, cfg.dataset, around=lambda: self.run.phase(
            "prior", f"building the tiny prior of {cfg.dataset} once, before round 1"))

    def aggregate_valid(self, server_round: int, valid: list[Message]):
        for r in valid:  # what each client's representation cache costs (reported once per client)
            m = r.content.metric_records[METRICS_KEY]
            pid = partition_of(r)
            row = self._cache.setdefault(-1 if pid is None else pid, {"cache_bytes": 0, "feature_seconds": 0.0})
            row["cache_bytes"] = int(m.get(P.CACHE_BYTES, 0))
            row["feature_seconds"] += float(m.get(P.FEATURE_SECONDS, 0.0))
        return super().aggregate_valid(server_round, valid)

    def execute(self, grid) -> dict[str, Any]:
        self.build_prior()
        out = super().execute(grid)
        if self._cache:
            out["representation_cache_bytes"] = {str(k): v["cache_bytes"] for k, v in sorted(self._cache.items())}
            out["representation_cache_bytes_total"] = sum(v["cache_bytes"] for v in self._cache.values())
            out["feature_seconds_total"] = round(sum(v["feature_seconds"] for v in self._cache.values()), 3)
        return out
