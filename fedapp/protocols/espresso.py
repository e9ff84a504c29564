"""Espresso's protocol (CVPR 2026): one upload per client, then one evaluation.

    query.prior  (when the server ships the built-in prior) down: PRIOR_DIGEST_KEY, and in a wave also the
                    weights (PRIOR_WEIGHTS_KEY + PRIOR_FILES_KEY)   up: HAS_PRIOR (fedapp.server.prior_waves)
    train     down: the run config (+ PRIOR_DIGEST_KEY: the shipped prior this node holds; a folder or hub
                    prior each node loads itself)
              up:   UPLOAD_KEY (conditions, cluster sizes, GMM of z^T, class counts) + metrics
    evaluate  down: the global classifier   up: its accuracy on the client's real test split

The upload's arrays (ARRAY_NAMES: class_counts, embeddings, embedding_class, cluster_sizes, gmm_class,
gmm_weights, gmm_means, gmm_variances) depend on the switches: `expected_shapes` is the schema and
`validate_upload` the check every upload passes before the server synthesises from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flwr.app import RecordDict

from fedapp.options import AUTO, ConfigError, opt, refusal, refuse
from fedapp.models.precision import PRECISIONS
from fedapp.models.prior.samplers import (DEFAULT_GAMMA2, DEFAULT_ZIGZAG_T, SPACINGS, ZIGZAG_CONVENTIONS,
                                          SamplerSettings)
from fedapp.protocols import EVALUATE, METRICS_KEY, NUM_EXAMPLES_KEY, Phase, ShardFacts
from fedapp.protocols.records import check_arrays, check_at_most, check_float, check_integer, tensors_of

UPLOAD_KEY = "upload"  # ArrayRecord: the client's one upload
# Arrays inside UPLOAD_KEY; which of them an upload carries depends on the switches (expected_shapes)
CLASS_COUNTS = "class_counts"  # (K,) images per class: always
# learned conditions (espresso.conditions != prompts): (E, L, D) token embeddings, their class (E,), images (E,)
EMBEDDINGS, EMBEDDING_CLASS, CLUSTER_SIZES = "embeddings", "embedding_class", "cluster_sizes"
# the noise GMM (espresso.init = gmm), one row per class with images: class (G,), weights (G, M), means and
# variances (G, M, latent dim)
GMM_CLASS, GMM_WEIGHTS, GMM_MEANS, GMM_VARIANCES = "gmm_class", "gmm_weights", "gmm_means", "gmm_variances"
ARRAY_NAMES = (CLASS_COUNTS, EMBEDDINGS, EMBEDDING_CLASS, CLUSTER_SIZES, GMM_CLASS, GMM_WEIGHTS, GMM_MEANS,
               GMM_VARIANCES)
PRIOR_WEIGHTS_KEY = "prior-weights"  # ArrayRecord: the shipped prior's tensors (fedapp.models.prior.shipping)
PRIOR_FILES_KEY = "prior-files"  # ConfigRecord: the shipped prior's configs and tokenizer files
PRIOR_DIGEST_KEY = "prior-digest"  # ConfigRecord {SHA256: hex}: names the shipped prior (shipping.records_digest)
SHA256 = "sha256"
HAS_PRIOR = "has-prior"  # query.prior metric: 1 when the node holds the named prior, else 0
CLIENT_SECONDS = "client-seconds"  # train metric: seconds of the client's work
NUM_CONDITIONS = "num-conditions"  # train metric

# Bounds of an upload's real-valued parts, beyond which it is not what a client computes:
# A coordinate of a forward-diffused latent z^T has variance abar_T Var(z^0) + (1 - abar_T), about 1;
# a diagonal GMM component fitted to a handful of them reaches ~10 (7 measured with 16 samples).
GMM_MAX_VARIANCE = 1e2
# z^T's coordinates are about N(0, 1): a component mean beyond 100 standard deviations is not a fit.
GMM_MAX_ABS_MEAN = 1e2
# Text encoders emit token vectors of norm O(10) (CLIP ViT-L/14: ~28; the tiny prior: ~6), and condition
# learning starts there, moving a coordinate by ~lr per Adam step: 1e3 per token is far above any of them.
EMBEDDING_MAX_NORM = 1e3


def within_shard(content: RecordDict, facts: ShardFacts) -> str | None:
    """class_counts at most the client's shard's (the server synthesises ratio x count images per
    class), summing to num-examples."""
    counts = content.array_records[UPLOAD_KEY][CLASS_COUNTS].numpy()
    why = check_at_most(CLASS_COUNTS, counts, facts.class_counts())
    n = content.metric_records[METRICS_KEY][NUM_EXAMPLES_KEY]
    if why is None and int(counts.sum()) != n:
        why = f"class_counts sum to {int(counts.sum())} but {NUM_EXAMPLES_KEY}={n!r}"
    return why


PRIOR = Phase("query.prior", down=(PRIOR_DIGEST_KEY, PRIOR_WEIGHTS_KEY, PRIOR_FILES_KEY), up=(METRICS_KEY,),
              doc="does the node hold the shipped prior (digest down; the weights too in a wave)",
              metrics=(HAS_PRIOR,))
TRAIN = Phase("train", down=(PRIOR_DIGEST_KEY,), up=(UPLOAD_KEY, METRICS_KEY),
              doc="conditions + GMM + class counts up; the shipped prior's digest down",
              metrics=(NUM_EXAMPLES_KEY, CLIENT_SECONDS, NUM_CONDITIONS), bound=within_shard)
PHASES = (PRIOR, TRAIN, EVALUATE)
SYNTHETIC_FILE = "synthetic.safetensors"  # in the run folder, with espresso.save-synthetic
# espresso.evaluate-clients=auto: every client up to this many; beyond, a seeded sample of this many (the 1.6 MB
# classifier to each of 1,000 clients is 1.6 GB down, where a sample already estimates the clients' mean accuracy)
AUTO_EVALUATE_CLIENTS = 100


def validate_has_prior(content: RecordDict) -> str | None:
    """A query.prior reply: HAS_PRIOR is 0 or 1."""
    value = content.metric_records[METRICS_KEY][HAS_PRIOR]
    return None if value in (0, 1) else f"{HAS_PRIOR}={value!r}: must be 0 or 1"


@dataclass(frozen=True)
class EspressoOptions:
    clusters: int = opt(4, low=1, help="J: clusters (conditions) per class; min(J, n) for a class of n images")
    gmm_components: int = opt(4, low=1, help="M: components of each class's diagonal GMM of z^T")
    ratio: float = opt(5.0, low=0.0, low_open=True, help="synthetic images per real image, per client and class")
    conditions: str = opt("cluster", choices=("prompts", "class", "cluster"),
                          help="prompts: class prompt only; class: one learned condition per class; "
                               "cluster: J per class (C)")
    init: str = opt("gmm", choices=("gaussian", "gmm"), help="z^T from N(0, I) or from the client's GMM (G)")
    sampler: str = opt("zigzag", choices=("ddim", "zigzag"), help="DDIM or Z-sampling (Z)")
    zigzag_t: int = opt(DEFAULT_ZIGZAG_T, low=0, high=1000, help="T_z: zigzag on steps with t > T_z")
    gamma1: float | str = opt(AUTO, auto=True, low=0.0,
                              help="guidance of the denoising steps (CFG vs the empty prompt); auto: the prior's "
                                   "own (tiny 3.0, Stable Diffusion 7.5)")
    gamma2: float = opt(DEFAULT_GAMMA2, low=0.0, help="guidance of Z-sampling's inversion step (< gamma1)")
    zigzag: str = opt("paper", choices=ZIGZAG_CONVENTIONS,
                      help="Z-sampling's inversion: paper (UNet at t-1, every step above T_z) or official (the "
                           "Zigzag authors' code: UNet at t, every step above T_z but the last)")
    steps: int = opt(10, low=1, high=1000, help="DDIM steps of the server's sampler: a zigzag at every step above "
                                                 "T_z (trailing, T_z=800: 2 at stride 100; the paper's ~50: 10 at "
                                                 "stride 20, 5x the synthesis time)")
    spacing: str = opt("trailing", choices=SPACINGS,
                       help="timestep spacing of the sampler: trailing starts at t = T-1 (where the model was "
                            "trained); leading at T - T/steps. The clients fit the GMM of z^T at that first level")
    embed_steps: int = opt(100, low=0,
                           help="Adam steps of condition learning; every condition gets a gradient each step")
    embed_lr: float = opt(0.05, low=0.0, low_open=True, help="Adam learning rate of condition learning")
    embed_batch: int = opt(1, low=1, help="images per condition per step (a cluster's images when fewer); all "
                                          "conditions' rows go through the UNet in one batched call")
    condition_chunk: int = opt(0, low=0, help="rows of a condition-learning step per UNet call, their gradients "
                                              "summed before the step (the same gradient at a chunk's memory); "
                                              "0: every row in one call")
    mixup_pairs: int = opt(64, low=1, help="MixUp'd latents per class for the GMM")
    mixup_alpha: float = opt(1.0, low=0.0, low_open=True, help="MixUp lambda ~ Beta(alpha, alpha)")
    diffusions_per_latent: int = opt(4, low=1, help="forward diffusions (fresh eps) of each MixUp'd latent")
    features: str = opt("unet", help="clustering features: unet (the prior's DIFT features) or a DINOv2/CLIP id/folder")
    synth_batch: int = opt(64, low=1, help="images per sampler call on the server")
    precision: str = opt("fp32", choices=PRECISIONS,
                         help="the server sampler's UNet calls: fp32; bf16 (bfloat16 autocast, ~1.8x faster on a CPU "
                              "with AVX-512 BF16 or AMX: docs/benchmarks.md#sampling); auto: bf16 on such a CPU, "
                              "fp32 elsewhere")
    evaluate_clients: int | str = opt(AUTO, auto=True, low=0,
                                      help="clients the evaluate phase sends the classifier to: auto, every client "
                                           f"up to {AUTO_EVALUATE_CLIENTS} clients and beyond that a sample of "
                                           f"{AUTO_EVALUATE_CLIENTS} (or min-clients, if more) drawn from the seed; "
                                           "N, a sample of N drawn from the seed (at least min-clients); 0, none "
                                           "(the server's global test set only)")
    ship_prior: str = opt("auto", choices=("auto", "all", "never"),
                          help="auto: the built-in tiny prior goes to the nodes that lack it (named by its sha256; "
                               "the weights in doubling waves, about once per machine: a simulation's actors share "
                               "their machine's cache); all: to every node that lacks it at once (a deployment, "
                               "one SuperNode per machine: one round of questions); never: each node loads it "
                               "from its own cache. A folder or hub prior is never sent")
    save_synthetic: bool = opt(False, help="also write the synthetic set to <run dir>/synthetic.safetensors "
                                           "(x, y, client) for diagnostics")

    def __post_init__(self) -> None:
        if self.gamma1 != AUTO and (why := gamma2_problem(self, float(self.gamma1), repr(self.gamma1))):
            raise ConfigError(why)  # an auto gamma1 is the prior's: preflight checks it
        if self.mixup_pairs * self.diffusions_per_latent < self.gmm_components:
            raise refuse("espresso.mixup-pairs", self.mixup_pairs, "mixup-pairs x diffusions-per-latent must be >= "
                                                                   f"espresso.gmm-components={self.gmm_components}")

    def sampler_settings(self) -> SamplerSettings:
        """The server's sampler (espresso.sampler, steps, spacing, gamma1, zigzag-t, gamma2, zigzag) as Prior.sample
        takes it; gamma1 must be resolved first (guidance(): `auto` is the prior's own)."""
        if self.gamma1 == AUTO:
            raise ValueError("espresso.gamma1='auto': resolve it (protocols.espresso.guidance) before sampling")
        return SamplerSettings(sampler=self.sampler, num_steps=self.steps, guidance=float(self.gamma1),
                               spacing=self.spacing, zigzag_t=self.zigzag_t, gamma2=self.gamma2, zigzag=self.zigzag,
                               precision=self.precision)


# ---- validation of an upload ---------------------------------------------------------------------
def expected_shapes(opts: EspressoOptions, num_classes: int, cond_shape: tuple[int, int],
                    latent_dim: int) -> dict[str, tuple]:
    exp: dict[str, tuple] = {CLASS_COUNTS: (num_classes,)}
    if opts.conditions != "prompts":
        exp.update({EMBEDDINGS: (None, *cond_shape), EMBEDDING_CLASS: (None,), CLUSTER_SIZES: (None,)})
    if opts.init == "gmm":
        m = opts.gmm_components
        exp.update({GMM_CLASS: (None,), GMM_WEIGHTS: (None, m), GMM_MEANS: (None, m, latent_dim),
                    GMM_VARIANCES: (None, m, latent_dim)})
    return exp


def _check_conditions(u: dict[str, torch.Tensor], counts: torch.Tensor, per_class: int) -> str | None:
    cls, sizes = u[EMBEDDING_CLASS], u[CLUSTER_SIZES]
    if not len(u[EMBEDDINGS]) == len(cls) == len(sizes):
        return "embeddings, embedding_class and cluster_sizes differ in length"
    if len(cls) and (cls.min() < 0 or cls.max() >= len(counts)):
        return "embedding_class: class index out of range"
    if len(sizes) and sizes.min() < 1:
        return "cluster_sizes: a cluster with no images"
    norms = u[EMBEDDINGS].norm(dim=-1)  # (E, L): one per token of each condition
    if (norms > EMBEDDING_MAX_NORM).any():
        return f"embeddings: a token of norm {float(norms.max()):.3g} exceeds {EMBEDDING_MAX_NORM:g}"
    for c in range(len(counts)):
        sel = cls == c
        k, n = int(sel.sum()), int(counts[c])
        if n == 0 and k:
            return f"class {c}: conditions for a class with no images"
        if n and not 1 <= k <= per_class:
            return f"class {c}: {k} conditions, expected 1..{per_class}"
        if n and int(sizes[sel].sum()) != n:
            return f"class {c}: cluster sizes sum to {int(sizes[sel].sum())}, class count is {n}"
    return None


def _check_gmm(u: dict[str, torch.Tensor], counts: torch.Tensor) -> str | None:
    cls, w, var, means = u[GMM_CLASS], u[GMM_WEIGHTS], u[GMM_VARIANCES], u[GMM_MEANS]
    if not len(cls) == len(w) == len(means) == len(var):
        return "gmm_* arrays differ in their number of classes"
    if cls.tolist() != torch.nonzero(counts).flatten().tolist():
        return "gmm_class: must list exactly the classes with images, in order"
    if (w < 0).any() or ((w.sum(1) - 1).abs() > 1e-3).any():
        return "gmm_weights: negative or not summing to 1"
    if (var <= 0).any():
        return "gmm_variances: not positive"
    if (var > GMM_MAX_VARIANCE).any():
        return f"gmm_variances: max {float(var.max()):.3g} exceeds {GMM_MAX_VARIANCE:g}"
    if (means.abs() > GMM_MAX_ABS_MEAN).any():
        return f"gmm_means: |mean| up to {float(means.abs().max()):.3g} exceeds {GMM_MAX_ABS_MEAN:g}"
    return None


def validate_upload(content: RecordDict, *, opts: EspressoOptions, num_classes: int,
                    cond_shape: tuple[int, int], latent_dim: int, max_bytes: float | None = None) -> str | None:
    """Why an Espresso upload is unacceptable, or None: check_arrays (keys, shapes, numeric dtype,
    finite, size), then integer counts and floating-point embeddings and GMM, conditions consistent
    with the class counts (1..J per class with images, cluster sizes summing to the count, token norms
    at most EMBEDDING_MAX_NORM), GMM weights on the simplex, 0 < variances <= GMM_MAX_VARIANCE,
    |means| <= GMM_MAX_ABS_MEAN. The counts against the client's shard: TRAIN.bound (within_shard)."""
    rec = content.array_records.get(UPLOAD_KEY)
    why = check_arrays(rec, expected_shapes(opts, num_classes, cond_shape, latent_dim), max_bytes)
    if why is not None:
        return why
    u = tensors_of(rec)
    why = (check_integer(u, CLASS_COUNTS, EMBEDDING_CLASS, CLUSTER_SIZES, GMM_CLASS)
           or check_float(u, EMBEDDINGS, GMM_WEIGHTS, GMM_MEANS, GMM_VARIANCES))
    if why is not None:
        return why
    counts = u[CLASS_COUNTS]
    if counts.min() < 0 or counts.sum() == 0:
        return "class_counts: negative or all zero"
    if opts.conditions != "prompts":
        why = _check_conditions(u, counts, opts.clusters if opts.conditions == "cluster" else 1)
    if why is None and opts.init == "gmm":
        why = _check_gmm(u, counts)
    return why


def needs_prior(opts: EspressoOptions) -> bool:
    """Prompts-only with Gaussian noise uploads class counts only: the client needs no prior."""
    return opts.conditions != "prompts" or opts.init == "gmm"


def guidance(opts: EspressoOptions, cfg) -> float:
    """gamma1: the option, or for "auto" the prior's own guidance (read from its folder, no weights)."""
    if opts.gamma1 != AUTO:
        return float(opts.gamma1)
    from fedapp.models.prior import prior_guidance

    return prior_guidance(cfg.prior, cfg.dataset)


def evaluation_size(opts: EspressoOptions, num_clients: int, min_clients: int) -> int:
    """How many of `num_clients` clients the evaluate phase asks (espresso.evaluate-clients): auto, all of them up
    to AUTO_EVALUATE_CLIENTS and that many beyond (min-clients if more: its replies must reach min-clients);
    N, N of them (all when fewer exist); 0, none."""
    n = opts.evaluate_clients
    wanted = max(AUTO_EVALUATE_CLIENTS, min_clients) if n == AUTO else int(n)
    return min(wanted, num_clients)


def preflight(cfg) -> str | None:
    """Z-sampling needs gamma2 < gamma1, also when gamma1 comes from the prior; a sampled evaluate phase
    asks at least min-clients (its replies must reach min-clients)."""
    opts = cfg.options
    n = opts.evaluate_clients
    if n != AUTO and 0 < n < cfg.min_clients:
        return (f"espresso.evaluate-clients={n!r}: must be 0, 'auto' or >= min-clients={cfg.min_clients} "
                "(the evaluate phase needs min-clients replies)")
    if opts.sampler == "zigzag" and opts.gamma1 == AUTO:
        gamma1 = guidance(opts, cfg)
        return gamma2_problem(opts, gamma1, f"auto: {gamma1!r} for prior={cfg.prior!r}")
    return None


def gamma2_problem(opts: EspressoOptions, gamma1: float, gamma1_text: str) -> str | None:
    """Z-sampling injects semantics through gamma1 - gamma2: gamma2 must stay below gamma1 (the option, or for
    "auto" the prior's: EspressoOptions checks the first, preflight the second)."""
    if opts.sampler != "zigzag" or opts.gamma2 < gamma1:
        return None
    return refusal("espresso.gamma2", opts.gamma2, f"must be < espresso.gamma1 ({gamma1_text}); Z-sampling injects "
                                                   "semantics through gamma1 - gamma2")

