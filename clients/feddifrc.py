"""FedDifRC client (Wang et al., ICCV 2025): FedAvg local training with two diffusion regularisers.

Per client, once (the prior is frozen and the noise seeded, so the result never changes):
  1. DIFT-style decoder features (fedapp.models.features): x_i noised to timestep t with a seeded eps,
     one UNet pass per prompt, the chosen up-blocks' outputs global-average-pooled.
  2. Conditional diffusion representations F~_{i,p}: the features of x_i under prompt P_p, one PCA
     per up-block fitted on this client's own rows only, the blocks concatenated (paper: layers 2-4,
     256/128/128 dims on SD). Each block's PCA output is divided by its RMS norm (over the client's
     rows) so that blocks weigh alike and the L2 target has a fixed scale whatever the prior.
  3. Denoising representation H~_i: the same for a generic prompt (NDCR's stable target).
Then every local step adds, on the projection z_i = g(embedding(x_i)) of the model,

  TDCL  L_TDCL = log(1 + sum_{j≠pos} exp(s(z_i, F~_{i,j})/tau) / exp(s(z_i, F~_{i,pos})/tau))
               = cross-entropy of the prompt logits s(z_i, F~_{i,·})/tau with target pos,
        s the cosine similarity; pos = the sample's own class prompt, negatives the other classes'.
  NDCR  L_NDCR = sum_{q=1..d} (z_{i(q)} - H~_{i(q)})^2, averaged over the batch.

Self-supervised variant (feddifrc.labels = false): the positive prompt is "a photo of a similar
object", the negatives are all class prompts (the label is unknown, so none can be excluded), and
H~ comes from "a photo of a visual object". With labels, H~ comes from the empty prompt (the
unconditional branch the prior was trained with).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from torch import nn
from torch.nn import functional as F

from clients.classify import evaluate_reply, local_train, round_of, train_reply
from fedapp.client_context import ClientContext
from fedapp.models.classifier import build_classifier
from fedapp.models.text import class_prompts
from fedapp.protocols import ARRAYS_KEY, EVALUATE
from fedapp.seeds import derive_seed
from fedapp.protocols.feddifrc import (CACHE_BYTES, FEATURE_SECONDS, STATE_TARGETS, STATE_TARGETS_ID, TRAIN,
                                      num_up_blocks)

SIMILAR_PROMPT = "a photo of a similar object"  # self-supervised TDCL positive
VISUAL_PROMPT = "a photo of a visual object"  # self-supervised NDCR prompt
GENERIC_PROMPT = ""  # NDCR prompt with labels: the unconditional branch
_CACHE: dict[str, "DiffusionTargets"] = {}  # process memory: cache key -> representations
# Opt-in (the table command turns it on): raw features per (prompt, base-table row), shared by
# every client and split this process serves. Off, each client computes only its own rows.
SHARE_RAW_FEATURES = False
_RAW: dict[str, dict] = {}  # extractor key -> {(prompt, base row): pooled blocks}


@dataclass
class DiffusionTargets:
    """The frozen targets of one client, row i = shard.train sample i."""

    F: torch.Tensor  # (N, P, D) conditional diffusion representations F~_{i,p} (TDCL)
    pos: torch.Tensor  # (N,) index of the positive prompt of each sample
    H: torch.Tensor  # (N, D) denoising diffusion representation H~_i (NDCR)
    pcas: list | None = None  # the fitted per-block PCAs (kept for inspection, not in Context.state)

    @property
    def nbytes(self) -> int:
        return sum(t.element_size() * t.nelement() for t in (self.F, self.pos, self.H))


# ---- prompts and features ------------------------------------------------------------------------
def prompts_for(dataset: str, class_names: list[str], labels: bool) -> tuple[list[str], str]:
    """(the TDCL prompts P_0..P_{P-1}, the NDCR prompt). With labels: one per class (pos = y);
    without: the "similar object" prompt first (pos = 0), then every class prompt as a negative."""
    cls = class_prompts(dataset, class_names)
    return (cls, GENERIC_PROMPT) if labels else ([SIMILAR_PROMPT] + cls, VISUAL_PROMPT)


def raw_features(extractor, x: torch.Tensor, prompts: list[str], rows: torch.Tensor | None = None,
                 memo: dict | None = None) -> list[list[torch.Tensor]]:
    """out[p][b]: pooled up-block b features (N, C_b) of every image under prompt p.

    memo (optional, {(prompt, row): blocks}): features already computed for the same base-table row
    with the same extractor; a sample's features depend only on (image, prompt, t, eps), so they are
    reused (the table command runs several splits of one dataset in one process)."""
    if memo is None or rows is None:
        return [extractor.features(x, prompts=p).blocks for p in prompts]
    out = []
    for p in prompts:
        todo = [i for i, r in enumerate(rows.tolist()) if (p, r) not in memo]
        if todo:
            new = extractor.features(x[todo], prompts=p).blocks
            for k, i in enumerate(todo):
                memo[(p, int(rows[i]))] = [b[k].clone() for b in new]
        per_row = [memo[(p, int(r))] for r in rows.tolist()]
        out.append([torch.stack([blocks[b] for blocks in per_row]) for b in range(len(per_row[0]))])
    return out


def fit_block_pcas(rows: list[np.ndarray], dims: int, seed: int) -> list[Any]:
    """One scikit-learn PCA per up-block, fitted on that block's rows (this client's only), with
    min(dims, channels, rows) components."""
    from sklearn.decomposition import PCA

    return [PCA(n_components=min(dims, r.shape[1], r.shape[0]), random_state=seed).fit(r) for r in rows]


def project_blocks(pcas: list[Any], scales: list[float], blocks: list[torch.Tensor], dims: int) -> torch.Tensor:
    """PCA-reduce each block, divide by its RMS norm, zero-pad to `dims`, concatenate -> (N, dims·B)."""
    out = []
    for pca, scale, b in zip(pcas, scales, blocks):
        r = torch.from_numpy(pca.transform(b.double().numpy())).float() / scale
        out.append(F.pad(r, (0, dims - r.shape[1])))
    return torch.cat(out, dim=1)


def diffusion_targets(extractor, x: torch.Tensor, y: torch.Tensor, dataset: str, class_names: list[str],
                      labels: bool, pca_dims: int, seed: int = 0, rows: torch.Tensor | None = None,
                      memo: dict | None = None, fit_on: list[list[torch.Tensor]] | None = None) -> DiffusionTargets:
    """F~ (N, P, D), pos (N,) and H~ (N, D) of one client's images x with labels y (steps 1-3 above).
    The PCA of each block is fitted on the union of this client's conditional and generic rows, so
    F~ and H~ live in one space, the one the projection z_i is trained in (fit_on: raw features
    [P+1][B] of other images to fit it on instead, e.g. the public split's)."""
    prompts, ndcr_prompt = prompts_for(dataset, class_names, labels)
    feats = raw_features(extractor, x, prompts + [ndcr_prompt], rows, memo)  # [P+1][B] (N, C_b)
    n_blocks = len(feats[0])
    fit_feats = feats if fit_on is None else fit_on
    block_rows = [torch.cat([f[b] for f in fit_feats]).double().numpy() for b in range(n_blocks)]  # (N(P+1), C_b)
    pcas = fit_block_pcas(block_rows, pca_dims, seed)
    scales = [float(np.sqrt((p.transform(r) ** 2).sum(1).mean())) or 1.0 for p, r in zip(pcas, block_rows)]
    reduced = [project_blocks(pcas, scales, f, pca_dims) for f in feats]  # [P+1] (N, D)
    pos = y.long().clone() if labels else torch.zeros(len(x), dtype=torch.long)
    return DiffusionTargets(F=torch.stack(reduced[:-1], dim=1), pos=pos, H=reduced[-1], pcas=pcas)


# ---- the two losses ------------------------------------------------------------------------------
def tdcl_loss(z: torch.Tensor, F_: torch.Tensor, pos: torch.Tensor, tau: float) -> torch.Tensor:
    """TDCL: log(1 + sum_{j≠pos} exp(s(z,F_j)/tau) / exp(s(z,F_pos)/tau)), batch mean.
    z (B, D), F_ (B, P, D), pos (B,); s = cosine similarity."""
    s = F.cosine_similarity(z.unsqueeze(1), F_, dim=-1)  # (B, P)
    return F.cross_entropy(s / tau, pos)  # -log softmax_pos = log(1 + sum_neg/pos)


def ndcr_loss(z: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """NDCR: sum_{q=1..d} (z_(q) - H~_(q))^2 per sample, batch mean."""
    return ((z - H) ** 2).sum(dim=1).mean()


class FedDifRCLoss:
    """extra_loss for clients.classify.local_train: lambda_TDCL·L_TDCL + lambda_NDCR·L_NDCR on
    z = g(embedding) of the forward pass local_train just made; keeps running means of each term."""

    def __init__(self, targets: DiffusionTargets, lambda_tdcl: float, lambda_ndcr: float, tau: float):
        self.targets, self.lambda_tdcl, self.lambda_ndcr, self.tau = targets, lambda_tdcl, lambda_ndcr, tau
        self.sums, self.n = {"tdcl": 0.0, "ndcr": 0.0}, 0

    def __call__(self, model: nn.Module, xb: torch.Tensor, yb: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        z = model.project(model.embedding)
        dev = z.device
        loss = z.new_zeros(())
        if self.lambda_tdcl > 0:
            l_tdcl = tdcl_loss(z, self.targets.F[idx].to(dev), self.targets.pos[idx].to(dev), self.tau)
            loss = loss + self.lambda_tdcl * l_tdcl
            self.sums["tdcl"] += l_tdcl.item() * len(idx)
        if self.lambda_ndcr > 0:
            l_ndcr = ndcr_loss(z, self.targets.H[idx].to(dev))
            loss = loss + self.lambda_ndcr * l_ndcr
            self.sums["ndcr"] += l_ndcr.item() * len(idx)
        self.n += len(idx)
        return loss

    def means(self) -> dict[str, float]:
        return {k: v / max(self.n, 1) for k, v in self.sums.items()}


# ---- the per-client cache ------------------------------------------------------------------------
@lru_cache(maxsize=2)
def load_frozen_prior(spec: str, dataset: str, device: str):
    from fedapp.models.prior import load_prior

    return load_prior(spec, device=device, dataset=dataset)


def cache_key(ctx: ClientContext) -> str:
    """Everything the representations depend on: the data, the prior, t, blocks, PCA, prompts, seed."""
    c, o = ctx.cfg, ctx.cfg.options
    parts = (c.prior, c.dataset, c.partitioner, sorted(c.partitioner_params.items()), c.seed, c.image_size,
             ctx.partition_id, ctx.num_partitions, o.t, o.blocks, o.pca_dims, o.labels, o.pca_fit)
    return repr(parts)


def compute_targets(ctx: ClientContext) -> DiffusionTargets:
    """Steps 1-3 on this client's training split (no cache)."""
    from fedapp.models.features import UNetFeatureExtractor

    c, o, shard = ctx.cfg, ctx.cfg.options, ctx.shard
    prior = load_frozen_prior(c.prior, c.dataset, ctx.device)
    # eps of the noising step: one draw from the run seed shared by the federation (the paper's fixed
    # noise), so a sample's raw features do not depend on which client holds it
    seed = derive_seed("feddifrc-eps", c.seed)
    extractor = UNetFeatureExtractor(prior, t=o.t, up_blocks=o.blocks_for(prior.num_up_blocks), seed=seed)
    memo = _RAW.setdefault(repr((c.prior, c.dataset, c.image_size, o.t, extractor.up_blocks, seed, ctx.device)),
                           {}) if SHARE_RAW_FEATURES else None
    fit_on = None
    if o.pca_fit == "public":  # one basis for the federation, from data no client owns
        from feddata import load_server_data

        public = load_server_data(c.dataset, "iid", {}, c.seed, 2, image_size=c.image_size).public
        prompts, ndcr_prompt = prompts_for(c.dataset, list(shard.info.class_names), o.labels)
        fit_on = raw_features(extractor, public.x, prompts + [ndcr_prompt], public.index, memo)
    return diffusion_targets(extractor, shard.train.x, shard.train.y, c.dataset, list(shard.info.class_names),
                             o.labels, o.pca_dims, ctx.seed_for(0xFD1F), rows=shard.train.index, memo=memo,
                             fit_on=fit_on)


def client_targets(ctx: ClientContext) -> tuple[DiffusionTargets, float]:
    """(targets, seconds spent computing them: 0 when cached). Looked up in process memory, then
    in the node's Context.state (which survives a ClientApp process restart in deployment)."""
    key = cache_key(ctx)
    if key in _CACHE:
        return _CACHE[key], 0.0
    state = ctx.state
    if state is not None and STATE_TARGETS in state.array_records and \
            state.config_records.get(STATE_TARGETS_ID, {}).get("key") == key:
        t = state.array_records[STATE_TARGETS].to_torch_state_dict()
        _CACHE[key] = DiffusionTargets(F=t["F"], pos=t["pos"], H=t["H"])
        return _CACHE[key], 0.0
    t0 = time.time()
    targets = compute_targets(ctx)
    _CACHE[key] = targets
    if state is not None:
        state[STATE_TARGETS] = ArrayRecord({"F": targets.F, "pos": targets.pos, "H": targets.H})
        state[STATE_TARGETS_ID] = ConfigRecord({"key": key})
    return targets, time.time() - t0


# ---- handlers ------------------------------------------------------------------------------------
def model_from_message(msg: Message, ctx: ClientContext) -> nn.Module:
    proj_dim = ctx.cfg.options.projection_dim(num_up_blocks(ctx.cfg))
    model = build_classifier(ctx.cfg.model, ctx.shard.info.num_classes, proj_dim=proj_dim)
    model.load_state_dict(msg.content.array_records[ARRAYS_KEY].to_torch_state_dict())
    return model


def handle_train(msg: Message, ctx: ClientContext) -> RecordDict:
    cfg, o, shard = ctx.cfg, ctx.cfg.options, ctx.shard
    targets, seconds = client_targets(ctx)
    model = model_from_message(msg, ctx)
    reg = FedDifRCLoss(targets, o.lambda_tdcl, o.lambda_ndcr, o.tau)
    stats = local_train(model, shard.train.x, shard.train.y, epochs=cfg.local_epochs, lr=cfg.lr,
                        batch=cfg.batch_size, seed=ctx.seed_for(round_of(msg)), device=ctx.device, extra_loss=reg)
    return train_reply(model, len(shard.train), {**{f"train_{k}": v for k, v in stats.items()},
                                                 **{f"train_{k}": v for k, v in reg.means().items()},
                                                 CACHE_BYTES: targets.nbytes, FEATURE_SECONDS: seconds})


def handle_evaluate(msg: Message, ctx: ClientContext) -> RecordDict:
    return evaluate_reply(model_from_message(msg, ctx), ctx)


HANDLERS = {TRAIN.message_type: handle_train, EVALUATE.message_type: handle_evaluate}
