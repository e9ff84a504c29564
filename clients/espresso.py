"""Espresso client (CVPR 2026, "Guiding Diffusion Models with Fine-Grained Conditions and
Semantics-Preserving Sampling for One-Shot Federated Learning"): what a client computes and uploads.

For each class y of client k (paper symbols):
1. features f_i = Phi(x_i) (the prior's UNet features by default, or a DINOv2/CLIP id), split into
   J clusters D^j_{k,y} with hierarchical clustering (min(J, n_y) when the class is small);
2. fine-grained condition learning, one condition c^j_{k,y} per cluster: a whole cross-attention
   sequence (L x D) fed to the UNet directly (no text encoder), initialised from the class prompt's
   encoding, minimising with the prior frozen
       Eq. (8)   E_{t, x in D^j_{k,y}, eps}
                     || eps - eps_theta(sqrt(abar_t) E(x) + sqrt(1-abar_t) eps, t, c^j_{k,y}) ||^2
3. GMM of the initial noise p(z^T_{k,y}): MixUp pairs of the class's latents z^0_{k,y,mix}, forward-
   diffuse each several times z^T = sqrt(abar_T) z^0_mix + sqrt(1-abar_T) eps, fit a diagonal GMM
   {w^{T,m}_{k,y}, mu^{T,m}_{k,y}, Sigma^{T,m}_{k,y}}_{m=1..M}.
Upload: the conditions, their cluster sizes, the GMM parameters and the class counts -- nothing else.

Switches (espresso.*): conditions = prompts (learn nothing) | class (one condition per class,
FedDEO-like) | cluster (J per class); init = gaussian (no GMM) | gmm. Functions below take tensors
and return tensors; only `handle_train` knows Flower.
"""

from __future__ import annotations

import functools

import logging
from typing import Protocol

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from clients.classify import handle_evaluate
from fedapp.client_context import ClientContext
from fedapp.models.prior.samplers import start_timestep
from fedapp.progress import track
from fedapp.protocols import EVALUATE, METRICS_KEY, NUM_EXAMPLES_KEY
from fedapp.protocols import espresso as P
from fedapp.seeds import derive_seed

log = logging.getLogger("fedapp")


# ---- 1. intra-class clustering ------------------------------------------------------------------
def cluster_class(features: torch.Tensor, clusters: int) -> np.ndarray:
    """Ward-linkage AgglomerativeClustering of one class's features into min(J, n) clusters.
    Returns a label in [0, min(J, n)) per image; every label is used (a partition of the class)."""
    from sklearn.cluster import AgglomerativeClustering

    n = len(features)
    k = min(clusters, n)
    if k <= 1:
        return np.zeros(n, dtype=np.int64)
    f = features.double().cpu().numpy()
    f = (f - f.mean(0)) / (f.std(0) + 1e-8)  # the pooled UNet blocks differ in scale
    return AgglomerativeClustering(n_clusters=k, linkage="ward").fit_predict(f).astype(np.int64)


def splits_a_class(counts: torch.Tensor, clusters: int) -> bool:
    """Whether clustering into `clusters` per class splits any class (min(J, n_y) > 1): only then are the
    features read. A client of one image per class (1,000 clients of digits) skips their UNet pass."""
    return clusters > 1 and int(counts.max()) > 1


def assign_conditions(y: torch.Tensor, features: torch.Tensor | None, classes: list[int],
                      clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner (N,): index of each image's condition, condition_class (E,)): conditions are numbered
    class by class, cluster by cluster. `clusters=1` (or features None) gives one per class."""
    owner = torch.full((len(y),), -1, dtype=torch.long)
    cond_class: list[int] = []
    for c in classes:
        idx = torch.nonzero(y == c).flatten()
        labels = (np.zeros(len(idx), dtype=np.int64) if features is None or clusters <= 1
                  else cluster_class(features[idx], clusters))
        owner[idx] = len(cond_class) + torch.from_numpy(labels)
        cond_class += [c] * (int(labels.max()) + 1)
    return owner, torch.tensor(cond_class, dtype=torch.long)


# ---- 2. fine-grained condition learning (Eq. 8) --------------------------------------------------
def diffusion_loss(prior, z0: torch.Tensor, cond: torch.Tensor, t: torch.Tensor,
                   eps: torch.Tensor) -> torch.Tensor:
    """Eq. (8), mean over the batch: ||eps - eps_theta(sqrt(abar_t) z0 + sqrt(1-abar_t) eps, t, c)||^2 --
    the prior's own training objective (Prior.loss: this for an eps-prior, its v/x0 target otherwise),
    with the gradient reaching the raw condition c."""
    return prior.loss(z0, cond, t, eps)


def condition_generator(seed: int, e: int) -> torch.Generator:
    """Condition e's own random stream: its (images, t, eps) draws do not depend on how many other
    conditions there are or in which order they are optimised (the batched and looped learners agree)."""
    return torch.Generator().manual_seed(derive_seed(seed, "condition", e))


def draw_rows(g: torch.Generator, members: torch.Tensor, batch: int, latent_shape: tuple, num_t: int):
    """One step's rows for one condition: min(batch, |cluster|) of its images (without replacement),
    a timestep t ~ U{0..T-1} and a noise eps ~ N(0, I) per image, in that order from its generator."""
    b = min(batch, len(members))
    idx = members[torch.randperm(len(members), generator=g)[:b]]
    t = torch.randint(0, num_t, (b,), generator=g)
    eps = torch.randn(b, *latent_shape, generator=g)
    return idx, t, eps


def condition_members(owner: torch.Tensor, num_conditions: int) -> list[torch.Tensor]:
    """The image indices of each condition e = 0..num_conditions-1 (owner: each image's condition)."""
    return [torch.nonzero(owner == e).flatten() for e in range(num_conditions)]


class ConditionLearner(Protocol):
    """What `espresso_upload` calls to learn the conditions: `learn_conditions` in production; research
    learners (experiments/espresso_condition_learners.py) are passed in with the same signature."""

    def __call__(self, prior, z0: torch.Tensor, owner: torch.Tensor, init: torch.Tensor, *, steps: int,
                 lr: float, batch: int, seed: int) -> torch.Tensor: ...


def learn_conditions(prior, z0: torch.Tensor, owner: torch.Tensor, init: torch.Tensor, *, steps: int,
                     lr: float, batch: int, seed: int, chunk: int = 0) -> torch.Tensor:
    """Optimise every condition c^j_{k,y} (E, L, D) on Eq. (8) with the prior frozen, all at once.

    Each step draws min(batch, |D^j|) images of every cluster (each with its own t and eps) and runs
    them through the UNet in one batched call, every row with its own condition's sequence. The loss
    is sum_j mean_{rows of j} ||.||^2, so c^j's gradient is exactly that of its own cluster's loss, and
    one Adam over the stacked (E, L, D) tensor is E independent Adams (Adam is per coordinate): the
    result equals the per-condition loop (experiments/espresso_condition_learners.py:
    learn_conditions_loop, one condition at a time), at a fraction of the UNet calls.

    chunk > 0 runs a step's rows through the UNet `chunk` at a time, each chunk's backward adding to the
    gradient before the one Adam step: the same gradient (rows are independent through the UNet; only the
    summation order differs) at a chunk's activation memory instead of the whole step's."""
    device = prior.device
    c = init.detach().clone().to(device, prior.dtype).requires_grad_(True)
    if steps <= 0:
        return c.detach().cpu()
    opt = torch.optim.Adam([c], lr=lr)
    members = condition_members(owner, len(init))
    gens = [condition_generator(seed, e) for e in range(len(init))]
    z0 = z0.to(device, prior.dtype)
    for _ in track(range(steps), "condition steps"):
        draws = [draw_rows(g, m, batch, z0.shape[1:], prior.num_train_timesteps) for g, m in zip(gens, members)]
        row_cond = torch.cat([torch.full((len(d[0]),), e) for e, d in enumerate(draws)]).to(device)
        weight = 1.0 / torch.cat([torch.full((len(d[0]),), float(len(d[0]))) for d in draws]).to(device, prior.dtype)
        idx, t, eps = (torch.cat(parts).to(device) for parts in zip(*draws))
        opt.zero_grad(set_to_none=True)
        for part in torch.arange(len(idx), device=device).split(chunk if chunk > 0 else len(idx)):
            rows = prior.loss(z0[idx[part]], c[row_cond[part]], t[part], eps[part].to(prior.dtype), reduction="none")
            (rows * weight[part]).sum().backward()  # the step's loss: sum over conditions of each one's mean
        opt.step()
    return c.detach().cpu()


# ---- 3. GMM of the initial noise p(z^T) ----------------------------------------------------------
def mixup_latents(z0: torch.Tensor, pairs: int, alpha: float, rng: np.random.Generator) -> torch.Tensor:
    """z^0_mix = lam z^0_i + (1 - lam) z^0_j for `pairs` random pairs of one class, lam ~ Beta(alpha, alpha)."""
    i = torch.from_numpy(rng.integers(0, len(z0), pairs))
    j = torch.from_numpy(rng.integers(0, len(z0), pairs))
    lam = torch.from_numpy(rng.beta(alpha, alpha, pairs)).to(z0.dtype).view(-1, *([1] * (z0.ndim - 1)))
    return lam * z0[i] + (1 - lam) * z0[j]


def forward_diffuse(prior, z_mix: torch.Tensor, t_T: int, times: int, seed: int) -> torch.Tensor:
    """Each z^0_mix diffused `times` times with fresh noise: z^T = sqrt(abar_T) z^0_mix + sqrt(1-abar_T) eps;
    returns (len(z_mix) * times, dim)."""
    g = torch.Generator().manual_seed(seed)
    z = z_mix.repeat_interleave(times, dim=0).to(prior.device, prior.dtype)
    eps = torch.randn(z.shape, generator=g).to(z)
    return prior.add_noise(z, eps, t_T).flatten(1).float().cpu()


def fit_noise_gmm(samples: torch.Tensor, components: int, seed: int) -> dict[str, torch.Tensor]:
    """Diagonal-covariance GaussianMixture of z^T samples (n, dim): weights (M,), means (M, dim),
    variances (M, dim) -- the paper's {w^{T,m}, mu^{T,m}, Sigma^{T,m}} with Sigma diagonal."""
    from sklearn.mixture import GaussianMixture

    gmm = GaussianMixture(n_components=components, covariance_type="diag", random_state=seed, reg_covar=1e-6)
    gmm.fit(samples.double().numpy())
    return {"weights": torch.from_numpy(gmm.weights_).float(), "means": torch.from_numpy(gmm.means_).float(),
            "variances": torch.from_numpy(gmm.covariances_).float()}


def class_noise_gmm(prior, z0: torch.Tensor, *, t_T: int, pairs: int, alpha: float, times: int,
                    components: int, seed: int) -> dict[str, torch.Tensor]:
    """MixUp -> forward diffusion to z^T -> diagonal GMM, for one class's latents z0."""
    rng = np.random.default_rng(seed)
    z_mix = mixup_latents(z0.cpu(), pairs, alpha, rng)
    return fit_noise_gmm(forward_diffuse(prior, z_mix, t_T, times, seed), components, seed)


# ---- the whole upload ----------------------------------------------------------------------------
def class_features(prior, x: torch.Tensor, spec: str, extractor=None) -> torch.Tensor:
    """Phi(x): the prior's UNet (DIFT) features for spec "unet", else a transformers vision backbone."""
    from fedapp.models.features import make_feature_extractor

    if extractor is None:
        extractor = (make_feature_extractor("unet", prior=prior) if spec == "unet"
                     else make_feature_extractor(spec, device=prior.device))
    return extractor(x).float().cpu()


def espresso_upload(prior, x: torch.Tensor, y: torch.Tensor, *, num_classes: int, prompts: list[str],
                    opts: P.EspressoOptions, seed: int, extractor=None,
                    learner: ConditionLearner | None = None) -> dict[str, torch.Tensor]:
    """Everything client k uploads, from its training images x (N, 3, H, W) in [-1, 1] and labels y.

    opts carries the espresso.* switches (conditions, clusters, embed_*, init, gmm_components,
    mixup_*, diffusions_per_latent, steps, features); `learner` learns the conditions (production's
    `learn_conditions` at `condition-chunk` rows a UNet call; a research one is passed in:
    experiments/espresso_condition_learners.py).
    Keys (P.ARRAY_NAMES): class_counts (K,); with learned conditions embeddings (E, L, D),
    embedding_class (E,), cluster_sizes (E,); with init=gmm gmm_class (G,), gmm_weights (G, M),
    gmm_means (G, M, dim), gmm_variances (G, M, dim)."""
    y = y.long()
    counts = torch.bincount(y, minlength=num_classes)
    classes = [int(c) for c in torch.nonzero(counts).flatten()]
    out: dict[str, torch.Tensor] = {P.CLASS_COUNTS: counts}
    if not P.needs_prior(opts):
        return out
    z0 = prior.encode_images(x).float().cpu()  # E(x)
    if opts.conditions != "prompts":
        clusters = opts.clusters if opts.conditions == "cluster" else 1
        feats = class_features(prior, x, opts.features, extractor) if splits_a_class(counts, clusters) else None
        owner, cond_class = assign_conditions(y, feats, classes, clusters)
        init = prior.encode_prompts([prompts[c] for c in cond_class.tolist()]).float().cpu()
        learn = learner or functools.partial(learn_conditions, chunk=opts.condition_chunk)
        out[P.EMBEDDINGS] = learn(prior, z0, owner, init, steps=opts.embed_steps, lr=opts.embed_lr,
                                  batch=opts.embed_batch, seed=seed + 1)
        out[P.EMBEDDING_CLASS] = cond_class
        out[P.CLUSTER_SIZES] = torch.bincount(owner, minlength=len(cond_class))
    if opts.init == "gmm":
        t_T = start_timestep(prior, opts.steps, opts.spacing)  # exactly where the server's sampler starts
        fits = [class_noise_gmm(prior, z0[y == c], t_T=t_T, pairs=opts.mixup_pairs, alpha=opts.mixup_alpha,
                                times=opts.diffusions_per_latent, components=opts.gmm_components,
                                seed=seed + 2 + c) for c in track(classes, "noise GMMs")]
        out[P.GMM_CLASS] = torch.tensor(classes, dtype=torch.long)
        for key, name in ((P.GMM_WEIGHTS, "weights"), (P.GMM_MEANS, "means"), (P.GMM_VARIANCES, "variances")):
            out[key] = torch.stack([f[name] for f in fits])  # class_noise_gmm's fit -> the upload's array
    return out


# ---- Flower handler ------------------------------------------------------------------------------
def announced_digest(msg: Message) -> str | None:
    rec = msg.content.config_records.get(P.PRIOR_DIGEST_KEY)
    return None if rec is None else str(rec.get(P.SHA256, ""))


def handle_prior(msg: Message, ctx: ClientContext[P.EspressoOptions]) -> RecordDict:
    """query.prior: keep the weights when they came (checked against the announced digest), then say
    whether this node holds the prior of that digest."""
    from fedapp.models.prior import cached_shipped, prior_from_records

    digest = announced_digest(msg)
    if not digest:
        raise ValueError(f"query.prior without a {P.PRIOR_DIGEST_KEY!r} record naming the prior")
    weights = msg.content.array_records.get(P.PRIOR_WEIGHTS_KEY)
    files = msg.content.config_records.get(P.PRIOR_FILES_KEY)
    if weights is not None and files is not None:
        prior_from_records(weights, files, expect=digest)
    return RecordDict({METRICS_KEY: MetricRecord({P.HAS_PRIOR: int(cached_shipped(digest) is not None)})})


def load_client_prior(msg: Message, cfg, device: str):
    """The prior: the shipped one this node holds when the server named one by digest, else loaded from
    this node's own disk or cache; a node that lacks it fails with the one-line reason."""
    from fedapp.models.prior import cached_shipped, load_frozen_prior

    digest = announced_digest(msg)
    if digest is not None:
        folder = cached_shipped(digest)
        if folder is None:
            raise ValueError(f"this node does not hold the shipped prior {digest[:16]}… (query.prior comes first)")
        return load_frozen_prior(str(folder), None, device)
    try:
        return load_frozen_prior(cfg.prior, cfg.dataset, device)
    except (ValueError, OSError) as err:
        raise ValueError(f"this node cannot load prior={cfg.prior!r}: {str(err).splitlines()[0][:300]}") from None


def handle_train(msg: Message, ctx: ClientContext[P.EspressoOptions]) -> RecordDict:
    """The one upload: conditions + GMM + class counts."""
    import time

    from fedapp.models.text import class_prompts

    cfg, opts = ctx.cfg, ctx.cfg.options
    prior = load_client_prior(msg, cfg, ctx.device) if P.needs_prior(opts) else None
    shard = ctx.shard
    t0 = time.time()
    up = espresso_upload(prior, shard.train.x, shard.train.y, num_classes=shard.info.num_classes,
                         prompts=class_prompts(cfg.dataset, shard.info.class_names), opts=opts,
                         seed=ctx.seed_for(0))
    metrics = MetricRecord({NUM_EXAMPLES_KEY: len(shard.train), P.CLIENT_SECONDS: time.time() - t0,
                            P.NUM_CONDITIONS: int(len(up.get(P.EMBEDDING_CLASS, [])))})
    return RecordDict({P.UPLOAD_KEY: ArrayRecord(up), METRICS_KEY: metrics})


HANDLERS = {P.PRIOR.message_type: handle_prior, P.TRAIN.message_type: handle_train,
            EVALUATE.message_type: handle_evaluate}
