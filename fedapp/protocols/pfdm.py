"""PFDM's protocol (CVPR 2026) and its generation baselines'.

pfdm:
    train         down: the run config   up: UPLOAD_KEY {X: x~ = sqrt(abar_t0) CLIP(x, C) + sqrt(1-abar_t0) z,
                                          Y: labels} + metrics (num-examples, t0)
    query.sample  down: SHARED_KEY (the shared denoiser z_w)   up: SAMPLES_KEY {X, Y, PRIVATE_ONLY}
                  (evaluation only: the server scores the personalised samples)
dpdm:             train         down/up: as fedavg-ddpm, each client training with DP-SGD (up also
                                metrics: dp_epsilon spent so far, dp_noise_multiplier)
local-only:       query.sample  down: nothing   up: SAMPLES_KEY {X, Y}
fedavg-ddpm:      train         down/up: the DDPM's weights (ARRAYS_KEY), as FedAvg's train phase
                                (up also metrics: num-examples, train_loss)
centralized-ddpm: no exchange (an oracle)
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import RecordDict

from fedapp.options import ConfigError, opt
import numpy as np

from fedapp.models.ddpm import HANDOVERS, SHARED_MODES  # pfdm.shared: what z_w models (shared_objective)
from fedapp.protocols import ARRAYS_KEY, METRICS_KEY, NUM_EXAMPLES_KEY, Phase, ShardFacts
from fedapp.protocols.records import check_arrays, check_at_most

UPLOAD_KEY = "upload"  # ArrayRecord {x, y}: the local-DP release
SHARED_KEY = "shared"  # ArrayRecord: z_w's weights
SAMPLES_KEY = "samples"  # ArrayRecord {x, y[, private_only]}: generated images for scoring
T0_METRIC = "t0"  # train metric: the level the client released at
TRAIN_LOSS_METRIC = "train_loss"  # fedavg-ddpm train metric: the client's last loss
DP_EPSILON_METRIC = "dp_epsilon"  # dpdm train metric: epsilon the client has spent so far (Opacus' RDP accountant)
DP_NOISE_METRIC = "dp_noise_multiplier"  # dpdm train metric: sigma / clip of its DP-SGD
STATE_PRIVATE = "pfdm.private"  # node state, never sent: the private denoiser's weights
# Arrays inside UPLOAD_KEY and SAMPLES_KEY
X, Y = "x", "y"  # images (N, C, H, W) and their integer class labels (N,)
PRIVATE_ONLY = "private_only"  # SAMPLES_KEY of pfdm: the private denoiser's own samples T -> 0, for the same Y
ARRAY_NAMES = (X, Y, PRIVATE_ONLY)  # spelled here only (tests/test_architecture.py)
PRIVATE_LEVELS = ("below-t0", "all")  # pfdm.private-levels: (0, t0] or (0, T]

def within_shard(content: RecordDict, facts: ShardFacts) -> str | None:
    """One released image per training image of the shard: labels per class at most the shard's,
    as many as num-examples (the server trains its shared denoiser on the union of the releases)."""
    y = content.array_records[UPLOAD_KEY][Y].numpy()
    why = check_at_most("labels per class", np.bincount(y, minlength=facts.num_classes), facts.class_counts())
    n = content.metric_records[METRICS_KEY][NUM_EXAMPLES_KEY]
    if why is None and len(y) != n:
        why = f"{len(y)} released images but {NUM_EXAMPLES_KEY}={n!r}"
    return why


TRAIN = Phase("train", down=(), up=(UPLOAD_KEY, METRICS_KEY),
              doc="private denoiser trained and kept; clipped, forward-diffused data released",
              metrics=(NUM_EXAMPLES_KEY, T0_METRIC), bound=within_shard)
SAMPLE = Phase("query.sample", down=(SHARED_KEY,), up=(SAMPLES_KEY,),
               doc="shared T -> t0, private t0 -> 0; samples back for scoring")
LOCAL_SAMPLE = Phase("query.sample", down=(), up=(SAMPLES_KEY,), doc="local-only: samples of the own DDPM")
FEDAVG_TRAIN = Phase("train", down=(ARRAYS_KEY,), up=(ARRAYS_KEY, METRICS_KEY), doc="fedavg-ddpm round",
                     metrics=(NUM_EXAMPLES_KEY, TRAIN_LOSS_METRIC))
DPDM_TRAIN = Phase("train", down=(ARRAYS_KEY,), up=(ARRAYS_KEY, METRICS_KEY), doc="dpdm round: DP-SGD steps",
                   metrics=(NUM_EXAMPLES_KEY, TRAIN_LOSS_METRIC, DP_EPSILON_METRIC, DP_NOISE_METRIC))
PHASES = (TRAIN, SAMPLE, LOCAL_SAMPLE, FEDAVG_TRAIN, DPDM_TRAIN)


@dataclass(frozen=True)
class PFDMOptions:
    """Options of pfdm and its generation baselines (local-only, fedavg-ddpm, dpdm, centralized-ddpm)."""

    t0: int = opt(0, low=0, high=1000,
                  help="forward-diffusion level of the upload; 0: smallest t0 meeting pfdm.epsilon")
    epsilon: float = opt(10.0, low=0.0, low_open=True,
                         help="target epsilon: LDP of the upload (pfdm, when pfdm.t0 = 0); "
                              "DP-SGD over all rounds (dpdm, when pfdm.dp-noise = 0)")
    clip: float = opt(10.0, low=0.0, low_open=True, help="C: per-sample L2 clipping norm of the upload")
    delta: float = opt(1e-5, low=0.0, low_open=True, high=0.5, help="LDP delta")
    accountant: str = opt("bound", choices=("bound", "rdp", "pld"),
                          help="epsilon of a release: the paper's closed-form bound, or a tight RDP / PLD "
                               "accountant (dp-accounting); picks t0 when pfdm.t0 = 0")
    local_steps: int = opt(300, low=1,
                           help="steps of each client's denoiser "
                                "(private / local-only; fedavg-ddpm, dpdm: in total over rounds)")
    private_levels: str = opt("below-t0", choices=PRIVATE_LEVELS,
                              help="levels the private denoiser trains on: below-t0 = (0, t0], the only ones "
                                   "PFDM samples it on (Algorithm 2), so the whole budget goes there; all = (0, T] "
                                   "(the tables measured before this option). The private-only reference is "
                                   "always a private model trained on all levels")
    shared: str = opt("relative", choices=SHARED_MODES,
                      help="z_w: relative = levels (t0, T] of the clean data with the uploads as x_t0 (a re-scaled "
                           "eps target), sampled T -> t0; algorithm2 = the paper's Algorithm 2, a standard DDPM "
                           "trained on the uploads x~ as its data and sampled for all T levels")
    handover: str = opt("auto", choices=HANDOVERS,
                        help="how z_w's leg T -> t0 is sampled: auto = what passes the hand-over check "
                             "(docs/pfdm.md): bounded for pfdm.shared = relative, ancestral for algorithm2; "
                             "ddim = deterministic DDIM on the raw eps; bounded = its "
                             "x0 estimate projected onto the data's known range (relative: the clipping ball "
                             "|x0| <= C; algorithm2: the range of an upload's norm) and eps re-derived from it; "
                             "ancestral = bounded, sampled ancestrally through every level (one UNet call per "
                             "level; pfdm.sample-steps then sets only the private leg)")
    dp_noise: float = opt(0.0, low=0.0, help="dpdm: DP-SGD noise multiplier (noise std / dp-clip); 0: the smallest "
                                              "that spends pfdm.epsilon over all rounds (Opacus' RDP accountant)")
    dp_clip: float = opt(1.0, low=0.0, low_open=True, help="dpdm: per-sample gradient clipping norm of DP-SGD")
    shared_steps: int = opt(300, low=1, help="steps of the server's shared denoiser (centralized-ddpm: its model)")
    batch: int = opt(64, low=1, help="minibatch of every denoiser's training (dpdm: the expected Poisson batch)")
    lr: float = opt(2e-3, low=0.0, low_open=True, help="Adam learning rate of every denoiser")
    ema: float = opt(0.0, low=0.0, help="EMA decay of every denoiser's weights (fedapp.models.ddpm.train_ddpm; "
                                        "e.g. 0.999, the budget sweep's recipe); 0: none, the last step's weights; "
                                        "fedavg-ddpm: per round's local steps; "
                                        "dpdm (DP-SGD): not applied")
    p_uncond: float = opt(0.0, low=0.0, high=1.0, help="label dropout of every denoiser (train_ddpm's p_uncond: "
                                                       "labels replaced by the null class at this rate); 0: none. "
                                                       "dpdm (DP-SGD): not applied")
    channels: str = opt("16,32", help="UNet2DModel block widths, comma separated")
    samples: int = opt(200, low=10, help="generated samples per client (balanced over classes) for the distances")
    sample_steps: int = opt(50, low=2, help="DDIM steps T -> 0 (split at t0 in proportion for pfdm)")
    attack_samples: int = opt(200, low=10, help="members and non-members per attack")
    ref_epochs: int = opt(8, low=1, help="epochs of the reference classifier (SmallCNN on the server's public data)")
    checkpoint_every: int = opt(200, low=0,
                                help="a run with a fixed run-name saves each denoiser's train state (weights, EMA, "
                                     "Adam, step, RNGs) every this many of its steps under <out-dir>/<run-name>/"
                                     "train_state, and a client its upload; the same run started again continues "
                                     "each from there (removed when the run completes); 0: none")

    def __post_init__(self) -> None:
        parts = self.channels.replace(" ", "").split(",")
        if not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ConfigError(f"pfdm.channels={self.channels!r}: must be comma-separated positive integers "
                              "such as '16,32'")
        if not self.ema < 1.0:
            raise ConfigError(f"pfdm.ema={self.ema!r}: must be < 1 (1 would keep the initial weights)")


def validate_upload(content: RecordDict, shape: tuple, num_classes: int, max_bytes: float | None) -> str | None:
    """x~ of the data's shape, float and finite; integer labels in range, one per image."""
    rec = content.array_records.get(UPLOAD_KEY)
    reason = check_arrays(rec, {X: (None, *shape), Y: (None,)}, max_bytes)
    if reason is None:
        x, y = rec[X].numpy(), rec[Y].numpy()
        if len(x) != len(y) or len(x) == 0:
            reason = f"{len(x)} images but {len(y)} labels"
        elif x.dtype.kind != "f" or y.dtype.kind not in "iu":
            reason = "x must be float and y integer"
        elif y.min() < 0 or y.max() >= num_classes:
            reason = f"labels outside [0, {num_classes})"
    return reason


def validate_samples(content: RecordDict, shape: tuple, keys: tuple[str, ...] = (X, Y)) -> str | None:
    """Samples for scoring: images of the data's shape, their labels (and the private-only images)."""
    rec = content.array_records.get(SAMPLES_KEY)
    images = {k: (None, *shape) for k in keys if k != Y}
    return check_arrays(rec, {**images, Y: (None,)})
