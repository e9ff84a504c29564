"""FedDifRC (Wang et al., ICCV 2025, arXiv 2507.06482): FedAvg whose clients add two regularisers
computed from a frozen text-to-image diffusion prior,

    L = L_CE + lambda_TDCL · L_TDCL + lambda_NDCR · L_NDCR        (clients/feddifrc.py)

The server side is FedAvg's (Flower's sample-weighted average, fedapp's upload validation); what
changes is the global model, which carries the projection head g mapping the embedding to the
dimension of the PCA-reduced diffusion representations, and the summary, which reports what the
clients' representation caches cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from flwr.app import Message

from fedapp.config import ConfigError, opt
from fedapp.models.classifier import build_classifier
from strategies.base import CLIENT_KEY, ServerRun
from strategies.fedavg import FedAvgStrategy

DEFAULT_BLOCKS = 3  # '' = the decoder's last three up-blocks (SD: 1,2,3 = the paper's layers 2-4)


@dataclass(frozen=True)
class FedDifRCOptions:
    lambda_tdcl: float = opt(1.0, low=0.0, help="weight of L_TDCL (0: the +NDCR-only ablation)")
    lambda_ndcr: float = opt(1.0, low=0.0, help="weight of L_NDCR (0: the +TDCL-only ablation)")
    tau: float = opt(0.04, low=0.0, low_open=True, help="TDCL temperature (official code: 0.04)")
    # The paper's timestep ablation (Fig. 6) finds t = 300 best; 261 in the official code is DIFT's
    # SD-2.1 default carried over, not a value the paper tunes. We follow the paper.
    t: int = opt(300, low=0, high=999, help="timestep of the one noising step (paper 300, official code 261)")
    pca_dims: int = opt(32, low=1, help="PCA components per up-block (paper on SD: 256/128/128); capped "
                                         "by the block's channels and the client's rows, zero-padded")
    labels: bool = opt(True, help="false: self-supervised prompts (no labels in TDCL/NDCR)")
    pca_fit: str = opt("client", choices=("client", "public"),
                       help="rows each block's PCA is fitted on: the client's own (private, one basis per "
                            "client) or the dataset's public split (one basis shared by all clients)")
    up_blocks: str = opt("", help="comma-separated decoder up-block indices; '' = the last three")

    def __post_init__(self) -> None:
        text = self.up_blocks.replace(" ", "")
        if text and not all(p.isdigit() for p in text.split(",")):
            raise ConfigError(f"feddifrc.up-blocks={self.up_blocks!r}: must be '' or comma-separated "
                              "non-negative integers such as '0,1,2'")

    @property
    def blocks(self) -> tuple[int, ...] | None:
        """The up-block indices, or None for the extractor's default (the last three)."""
        text = self.up_blocks.replace(" ", "")
        return tuple(int(p) for p in text.split(",")) if text else None

    @property
    def projection_dim(self) -> int:
        """D: pca_dims per block, concatenated; known without loading the prior."""
        return self.pca_dims * (len(self.blocks) if self.blocks else DEFAULT_BLOCKS)


class FedDifRCStrategy(FedAvgStrategy):
    def __init__(self, run: ServerRun):
        super().__init__(run)
        self._cache: dict[int, dict[str, float]] = {}

    def build_model(self):
        """The classifier plus the projection head g: embedding -> R^D that TDCL/NDCR act on."""
        cfg = self.run.cfg
        return build_classifier(cfg.model, self.server_data().info.num_classes,
                                proj_dim=cfg.options.projection_dim)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        for r in replies:  # what each client's representation cache costs (reported once per client)
            if r.has_error() or "metrics" not in r.content.metric_records:
                continue
            m = r.content.metric_records["metrics"]
            pid = int(r.content.config_records.get(CLIENT_KEY, {}).get("partition-id", -1))
            row = self._cache.setdefault(pid, {"cache_bytes": 0, "feature_seconds": 0.0})
            row["cache_bytes"] = int(m.get("cache-bytes", 0))
            row["feature_seconds"] += float(m.get("feature-seconds", 0.0))
        return super().aggregate_train(server_round, replies)

    def execute(self, grid) -> dict[str, Any]:
        out = super().execute(grid)
        if self._cache:
            out["representation_cache_bytes"] = {str(k): v["cache_bytes"] for k, v in sorted(self._cache.items())}
            out["representation_cache_bytes_total"] = sum(v["cache_bytes"] for v in self._cache.values())
            out["feature_seconds_total"] = round(sum(v["feature_seconds"] for v in self._cache.values()), 3)
        return out
