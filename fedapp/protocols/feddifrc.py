"""FedDifRC (Wang et al., ICCV 2025): FedAvg's protocol over a classifier whose embedding z_i (or a
projection head g on it) is pulled toward PCA-reduced diffusion representations. Besides FedAvg's train metrics a
client reports what its representation cache cost (CACHE_BYTES, FEATURE_SECONDS)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.options import AUTO, ConfigError, opt
from fedapp.protocols import EVALUATE
from fedapp.protocols.classify import train_phase

CACHE_BYTES = "cache-bytes"  # train metric: bytes of the client's cached targets
FEATURE_SECONDS = "feature-seconds"  # train metric: seconds spent computing them this round (0 when cached)
TRAIN_TDCL, TRAIN_NDCR = "train_tdcl", "train_ndcr"  # train metrics: the mean regulariser losses
TRAIN = train_phase(TRAIN_TDCL, TRAIN_NDCR, CACHE_BYTES, FEATURE_SECONDS)  # FedAvg's exchanges, more metrics
PHASES = (TRAIN, EVALUATE)
STATE_TARGETS = "feddifrc.targets"  # node state: the cached representations
STATE_TARGETS_ID = "feddifrc.targets-key"  # node state: the cache key they were computed for
DEFAULT_BLOCKS = 3  # '' = the decoder's last three up-blocks (SD: 1,2,3 = the paper's layers 2-4)
NDCR_FORMS = ("kl", "normalized-l2", "l2")


@dataclass(frozen=True)
class FedDifRCOptions:
    """Where the paper (arXiv 2507.06482) is unambiguous its equations decide; where it is silent, the
    official code (github hwang52/FedDifRC: main_FedDifRC.py, model/diffu_feature.py) does. docs/feddifrc.md
    lists each choice and the ablation row that shows what it moves."""

    lambda_tdcl: float = opt(1.0, low=0.0, help="weight of L_TDCL (0: the +NDCR-only ablation)")
    lambda_ndcr: float = opt(1.0, low=0.0, help="weight of L_NDCR (0: the +TDCL-only ablation)")
    tau: float = opt(0.04, low=0.0, low_open=True, help="TDCL temperature (official code: 0.04)")
    # The paper's timestep ablation (Fig. 6) finds t = 300 best; 261 in the official code is DIFT's
    # SD-2.1 default carried over, not a value the paper tunes. We follow the paper.
    t: int = opt(300, low=0, high=999, help="timestep of the one noising step (paper 300, official code 261)")
    ndcr_form: str = opt("kl", choices=NDCR_FORMS,
                         help="L_NDCR: the official code's KL(softmax(H~/|H~|) || softmax(z/|z|)) (kl), the "
                              "paper's sum of squares on unit-normalised z and H~ (normalized-l2), or on raw "
                              "vectors (l2)")
    feature_on: str = opt("backbone", choices=("backbone", "head"),
                          help="z_i: the backbone's own embedding (official code; the targets then have its size) "
                               "or a projection head on it")
    pool: str = opt("l2norm", choices=("l2norm", "mean"),
                    help="targets: per-pixel PCA of each up-block's map, then per component the L2 norm over "
                         "positions (official code; non-negative) or the mean")
    pca_dims: int | str = opt(AUTO, auto=True, low=1,
                              help="PCA components per up-block; auto: the embedding's size split 2:1:1... over "
                                   "the blocks (ResNet-10: 256/128/128, the paper's); capped by the block's "
                                   "channels, zero-padded")
    pca_fit: str = opt("public", choices=("public", "client"),
                       help="rows each block's PCA is fitted on: the dataset's public split (one basis shared by "
                            "all clients; no client data) or the client's own (one basis per client)")
    dynamic_condition: float = opt(0.0, low=0.0,
                                   help="> 0: TDCL's prompts carry c_i = h_k(x_i), the local model's embedding "
                                        "mapped to the text width with this norm relative to a prompt token's, "
                                        "recomputed every round (paper); 0: fixed targets (official main script)")
    noise_seed: int = opt(0, low=0, help="the one eps every image is noised with (and the basis' pixel sample): "
                                         "fixed across runs whatever `seed`, as the official code computes the "
                                         "features once and every run reuses them")
    labels: bool = opt(True, help="false: self-supervised prompts (no labels in TDCL/NDCR)")
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

    def target_dims(self, num_up_blocks: int, embed_dim: int) -> tuple[int, ...]:
        """PCA components per used block. auto: the embedding's size, half to the first block and the rest
        split evenly (the official 256/128/128 of a 512-d ResNet-10 feature), so z_i can be the embedding."""
        n = len(self.blocks_for(num_up_blocks))
        if self.pca_dims != AUTO:
            return (int(self.pca_dims),) * n
        if n == 1:
            return (embed_dim,)
        rest = (embed_dim // 2) // (n - 1)
        return (embed_dim - rest * (n - 1),) + (rest,) * (n - 1)

    def head_dim(self, num_up_blocks: int, embed_dim: int) -> int:
        """Output size of the projection head g (0: no head, z is the embedding)."""
        return sum(self.target_dims(num_up_blocks, embed_dim)) if self.feature_on == "head" else 0


def num_up_blocks(cfg) -> int:
    """The run's prior's decoder depth, read from its config: both sides size the targets by it."""
    from fedapp.models.prior import prior_up_blocks

    return prior_up_blocks(cfg.prior, cfg.dataset)


def target_dims(cfg) -> tuple[int, ...]:
    """The run's PCA components per block (from the prior's depth and the classifier's embedding size)."""
    from fedapp.models.classifier import embedding_dim

    return cfg.options.target_dims(num_up_blocks(cfg), embedding_dim(cfg.model))


def feddifrc_classifier(cfg, num_classes: int):
    """FedDifRC's classifier, which both sides train and average: z_i is its embedding, or the output of a
    projection head g sized to the diffusion targets (FedDifRCOptions.head_dim, from the prior's decoder depth
    and the embedding size). Call order is fixed: embedding_dim builds a throwaway SmallCNN, which draws from
    torch's global RNG before the model's own init."""
    from fedapp.models.classifier import build_classifier, embedding_dim

    head = cfg.options.head_dim(num_up_blocks(cfg), embedding_dim(cfg.model))
    return build_classifier(cfg.model, num_classes, proj_dim=head, keep_embedding=True)


def preflight(cfg) -> str | None:
    """Named up-blocks must exist in the prior's decoder; on the backbone the targets must have the
    embedding's size (fedapp.preflight calls this before the run)."""
    from fedapp.models.classifier import embedding_dim

    o = cfg.options
    n, named = num_up_blocks(cfg), o.blocks
    if named and not all(0 <= i < n for i in named):
        return f"feddifrc.up-blocks={o.up_blocks!r}: prior={cfg.prior!r} has up-blocks 0..{n - 1}"
    embed, dims = embedding_dim(cfg.model), o.target_dims(n, embedding_dim(cfg.model))
    if o.feature_on == "backbone" and sum(dims) != embed:
        return (f"feddifrc.pca-dims={o.pca_dims!r}: with feddifrc.feature-on='backbone' the {len(dims)} blocks' "
                f"components must add up to model={cfg.model!r}'s embedding size {embed} (they make {sum(dims)}); "
                "must be 'auto', or use feddifrc.feature-on='head'")
    return None
