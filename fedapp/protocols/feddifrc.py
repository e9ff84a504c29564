"""FedDifRC (Wang et al., ICCV 2025): FedAvg's protocol over a classifier with a projection head g
onto the dimension of the PCA-reduced diffusion representations. Besides FedAvg's train metrics a
client reports what its representation cache cost (CACHE_BYTES, FEATURE_SECONDS)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import ConfigError, opt
from fedapp.protocols import EVALUATE
from fedapp.protocols.classify import train_phase

NAMESPACE = "feddifrc"
RESUMABLE = True  # clients keep nothing between rounds that a resumed run would lack
USES_PRIOR = True  # the `prior` key must resolve before the run starts (fedapp.preflight)
CACHE_BYTES = "cache-bytes"  # train metric: bytes of the client's cached targets
FEATURE_SECONDS = "feature-seconds"  # train metric: seconds spent computing them this round (0 when cached)
TRAIN_TDCL, TRAIN_NDCR = "train_tdcl", "train_ndcr"  # train metrics: the mean regulariser losses
TRAIN = train_phase(TRAIN_TDCL, TRAIN_NDCR, CACHE_BYTES, FEATURE_SECONDS)  # FedAvg's exchanges, more metrics
PHASES = (TRAIN, EVALUATE)
STATE_TARGETS = "feddifrc.targets"  # node state: the cached representations
STATE_TARGETS_ID = "feddifrc.targets-key"  # node state: the cache key they were computed for
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
        """The up-block indices named, or None for the default (the prior's last three)."""
        text = self.up_blocks.replace(" ", "")
        return tuple(int(p) for p in text.split(",")) if text else None

    def blocks_for(self, num_up_blocks: int) -> tuple[int, ...]:
        """The up-blocks used with a prior whose decoder has `num_up_blocks`: the named ones, or its last
        min(3, n) (SD-1.5: 1, 2, 3 = the paper's layers 2-4)."""
        return self.blocks or tuple(range(max(0, num_up_blocks - DEFAULT_BLOCKS), num_up_blocks))

    def projection_dim(self, num_up_blocks: int) -> int:
        """D: pca_dims per block, concatenated (the projection head's output size)."""
        return self.pca_dims * len(self.blocks_for(num_up_blocks))


OPTIONS = FedDifRCOptions


def num_up_blocks(cfg) -> int:
    """The run's prior's decoder depth, read from its config: both sides size the projection head by it."""
    from fedapp.models.prior import prior_up_blocks

    return prior_up_blocks(cfg.prior, cfg.dataset)


def preflight(cfg) -> str | None:
    """Named up-blocks must exist in the prior's decoder (fedapp.preflight calls this before the run)."""
    n, named = num_up_blocks(cfg), cfg.options.blocks
    if named and not all(0 <= i < n for i in named):
        return f"feddifrc.up-blocks={cfg.options.up_blocks!r}: prior={cfg.prior!r} has up-blocks 0..{n - 1}"
    return None
