"""FedDifRC client (Wang et al., ICCV 2025): FedAvg local training with two diffusion regularisers.

Per client, once (the prior is frozen and the noise seeded, so the result never changes): the targets
of clients/feddifrc_targets.py, F~_{i,p} under each TDCL prompt P_p and H~_i under NDCR's prompt. Then
every local step adds, on z_i (the model's embedding, or a projection head on it: feddifrc.feature-on),

  TDCL  L_TDCL = log(1 + sum_{j≠pos} exp(s(z_i, F~_{i,j})/tau) / exp(s(z_i, F~_{i,pos})/tau))
               = cross-entropy of the prompt logits s(z_i, F~_{i,·})/tau with target pos,
        s the cosine similarity; pos = the sample's own class prompt, negatives the other classes'.
  NDCR  L_NDCR = sum_{q=1..d} (z_{i(q)} - H~_{i(q)})^2, batch mean (feddifrc.ndcr-form: the official code's KL
        form by default; the paper's sum of squares on unit-normalised vectors; or on raw vectors).

Self-supervised variant (feddifrc.labels = false): the positive prompt is "a photo of a similar
object", the negatives are all class prompts (the label is unknown, so none can be excluded), and
H~ comes from "a photo of a visual object". With labels, H~ comes from the empty prompt (the
unconditional branch the prior was trained with).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from torch import nn
from torch.nn import functional as F

from clients import feddifrc_targets as T
from clients.classify import evaluate_reply, local_train, round_of, train_reply
from fedapp.client_context import ClientContext
from fedapp.data import for_classifier
from fedapp.progress import track
from fedapp.protocols import ARRAYS_KEY, EVALUATE
from fedapp.protocols.feddifrc import (CACHE_BYTES, FEATURE_SECONDS, STATE_TARGETS, STATE_TARGETS_ID, TRAIN,
                                       FedDifRCOptions, feddifrc_classifier, target_dims)
from fedapp.protocols.weights import load_weights
from fedapp.seeds import derive_seed

_CACHE: dict[str, "DiffusionTargets"] = {}  # process memory: cache key -> targets
# Opt-in (the table command turns it on, and keeps it on disk between its processes): with a shared basis
# (pca-fit = public) a sample's target depends neither on its client nor on the run seed, so targets are
# kept per (prompt, base-table row) and shared by every client, split, seed and method. Off, each client
# computes only its own rows.
SHARE_TARGETS = False
_SHARED: dict[str, dict] = {}  # basis_key -> {"basis": TargetBasis, (prompt, row): (D,)}
# With pca-fit = public every client a process serves fits the same basis (same public images, prompts
# and noise-seed): fitted once per process (~2.8k UNet passes on mnist-5k), whatever SHARE_TARGETS says.
_BASES: dict[str, T.TargetBasis] = {}  # basis_key -> basis


def share_targets(enabled: bool) -> None:
    """Turn the process-wide target memo (SHARE_TARGETS) on or off: the in-process table runners' switch."""
    global SHARE_TARGETS
    SHARE_TARGETS = bool(enabled)


@dataclass
class DiffusionTargets:
    """The frozen targets of one client, row i = shard.train sample i."""

    F: torch.Tensor  # (N, P, D) conditional diffusion representations F~_{i,p} (TDCL)
    pos: torch.Tensor  # (N,) index of the positive prompt of each sample
    H: torch.Tensor  # (N, D) denoising diffusion representation H~_i (NDCR)
    basis: T.TargetBasis  # the per-block PCA basis and scales they were reduced with

    @property
    def nbytes(self) -> int:
        return sum(t.element_size() * t.nelement() for t in (self.F, self.pos, self.H))

    def to_arrays(self) -> dict[str, torch.Tensor]:
        return {"F": self.F, "pos": self.pos, "H": self.H,
                **{f"basis.{k}": v for k, v in self.basis.to_arrays().items()}}

    @classmethod
    def from_arrays(cls, a: dict[str, torch.Tensor], pool: str) -> "DiffusionTargets":
        basis = T.TargetBasis.from_arrays({k[6:]: v for k, v in a.items() if k.startswith("basis.")}, pool)
        return cls(F=a["F"], pos=a["pos"], H=a["H"], basis=basis)


# ---- the two losses ------------------------------------------------------------------------------
def tdcl_loss(z: torch.Tensor, F_: torch.Tensor, pos: torch.Tensor, tau: float) -> torch.Tensor:
    """TDCL: log(1 + sum_{j≠pos} exp(s(z,F_j)/tau) / exp(s(z,F_pos)/tau)), batch mean.
    z (B, D), F_ (B, P, D), pos (B,); s = cosine similarity."""
    s = F.cosine_similarity(z.unsqueeze(1), F_, dim=-1)  # (B, P)
    return F.cross_entropy(s / tau, pos)  # -log softmax_pos = log(1 + sum_neg/pos)


def ndcr_loss(z: torch.Tensor, H: torch.Tensor, form: str = "l2") -> torch.Tensor:
    """NDCR, batch mean. l2: sum_{q=1..d} (z_(q) - H~_(q))^2 (the paper's equation); normalized-l2: the
    same on z/|z| and H~/|H~| (scale-free); kl: KL(softmax(H~/|H~|) || softmax(z/|z|)) (official code)."""
    if form == "l2":
        return ((z - H) ** 2).sum(dim=1).mean()
    z, H = F.normalize(z, dim=1), F.normalize(H, dim=1)
    if form == "normalized-l2":
        return ((z - H) ** 2).sum(dim=1).mean()
    return F.kl_div(F.log_softmax(z, dim=1), F.softmax(H, dim=1), reduction="batchmean")


class FedDifRCLoss:
    """extra_loss for clients.classify.local_train: lambda_TDCL·L_TDCL + lambda_NDCR·L_NDCR on
    z = g(embedding) (g the identity on the backbone) of the forward pass local_train just made; keeps
    running means of each term."""

    def __init__(self, targets: DiffusionTargets, lambda_tdcl: float, lambda_ndcr: float, tau: float,
                 ndcr_form: str = "kl"):
        self.targets, self.lambda_tdcl, self.lambda_ndcr, self.tau = targets, lambda_tdcl, lambda_ndcr, tau
        self.ndcr_form = ndcr_form
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
            l_ndcr = ndcr_loss(z, self.targets.H[idx].to(dev), self.ndcr_form)
            loss = loss + self.lambda_ndcr * l_ndcr
            self.sums["ndcr"] += l_ndcr.item() * len(idx)
        self.n += len(idx)
        return loss

    def means(self) -> dict[str, float]:
        return {k: v / max(self.n, 1) for k, v in self.sums.items()}


# ---- the per-client cache ------------------------------------------------------------------------
def cache_key(ctx: ClientContext[FedDifRCOptions]) -> str:
    """Everything the static targets depend on: the data, the prior, t, blocks, basis, prompts, seed."""
    c, o = ctx.cfg, ctx.cfg.options
    parts = (c.prior, c.dataset, c.partitioner, sorted(c.partitioner_params.items()), c.seed, c.image_size,
             ctx.partition_id, ctx.num_partitions, o.t, o.blocks, target_dims(c), o.labels, o.pca_fit, o.pool,
             o.noise_seed)
    return repr(parts)


def extractor_for(ctx: ClientContext[FedDifRCOptions]):
    """The DIFT extractor of this run: its prior, t, blocks and one fixed eps (feddifrc.noise-seed: the
    paper's fixed noise), so a sample's maps depend neither on which client holds it nor on the run seed."""
    from fedapp.models.features import UNetFeatureExtractor
    from fedapp.models.prior import load_frozen_prior

    c, o = ctx.cfg, ctx.cfg.options
    prior = load_frozen_prior(c.prior, c.dataset, ctx.device)
    return UNetFeatureExtractor(prior, t=o.t, up_blocks=o.blocks_for(prior.num_up_blocks),
                                seed=derive_seed("feddifrc-eps", o.noise_seed))


def fit_images(ctx: ClientContext[FedDifRCOptions]) -> torch.Tensor:
    """The images the basis is fitted on: the public split (shared basis) or the client's own."""
    c = ctx.cfg
    if c.options.pca_fit == "client":
        return ctx.shard.train.x
    from feddata import load_server_data

    return load_server_data(c.dataset, "iid", {}, c.seed, 2, image_size=c.image_size).public.x


def basis_key(ctx: ClientContext[FedDifRCOptions], extractor) -> str:
    """Everything a public basis depends on (not the client, not the run seed: the public split is fixed)."""
    c, o = ctx.cfg, ctx.cfg.options
    return repr((c.prior, c.dataset, c.image_size, o.t, extractor.up_blocks, o.noise_seed, ctx.device,
                 target_dims(c), o.labels, o.pool))


def target_basis(ctx: ClientContext[FedDifRCOptions], extractor, prompts: list[str]) -> T.TargetBasis:
    """The per-block PCA basis: the client's own (pca-fit = client) or the public one, once per process."""
    c, o = ctx.cfg, ctx.cfg.options
    if o.pca_fit == "client":
        return T.fit_basis(extractor, fit_images(ctx), prompts, target_dims(c), o.pool, ctx.seed_for(0xFD1F))
    key = basis_key(ctx, extractor)
    if key not in _BASES:
        seed = derive_seed("feddifrc-pca", o.noise_seed)
        _BASES[key] = T.fit_basis(extractor, fit_images(ctx), prompts, target_dims(c), o.pool, seed)
    return _BASES[key]


def compute_targets(ctx: ClientContext[FedDifRCOptions]) -> DiffusionTargets:
    """F~, pos, H~ of this client's training split (no cache; the shared memo when SHARE_TARGETS)."""
    c, o, train = ctx.cfg, ctx.cfg.options, ctx.shard.train
    extractor = extractor_for(ctx)
    prompts, ndcr_prompt = T.prompts_for(c.dataset, list(ctx.shard.info.class_names), o.labels)
    shared = SHARE_TARGETS and o.pca_fit == "public"
    memo = _SHARED.setdefault(basis_key(ctx, extractor), {}) if shared else {}
    if "basis" not in memo:  # a memo loaded from disk brings its basis along
        memo["basis"] = target_basis(ctx, extractor, prompts + [ndcr_prompt])
    basis = memo["basis"]
    out = [T.memo_reduced(extractor, basis, train.x, p, train.index, memo) if shared
           else T.reduced(extractor, basis, train.x, p) for p in track(prompts + [ndcr_prompt], "target prompts")]
    pos = train.y.long().clone() if o.labels else torch.zeros(len(train), dtype=torch.long)
    return DiffusionTargets(F=torch.stack(out[:-1], dim=1), pos=pos, H=out[-1], basis=basis)


def client_targets(ctx: ClientContext[FedDifRCOptions]) -> tuple[DiffusionTargets, float]:
    """(targets, seconds spent computing them: 0 when cached). Looked up in process memory, then
    in the node's Context.state (which survives a ClientApp process restart in deployment)."""
    key = cache_key(ctx)
    if key in _CACHE:
        return _CACHE[key], 0.0
    state = ctx.state
    if state is not None and STATE_TARGETS in state.array_records and \
            state.config_records.get(STATE_TARGETS_ID, {}).get("key") == key:
        arrays = state.array_records[STATE_TARGETS].to_torch_state_dict()
        _CACHE[key] = DiffusionTargets.from_arrays(arrays, ctx.cfg.options.pool)
        return _CACHE[key], 0.0
    t0 = time.time()
    targets = compute_targets(ctx)
    _CACHE[key] = targets
    if state is not None:
        state[STATE_TARGETS] = ArrayRecord(targets.to_arrays())
        state[STATE_TARGETS_ID] = ConfigRecord({"key": key})
    return targets, time.time() - t0


def dynamic_targets(ctx: ClientContext[FedDifRCOptions], targets: DiffusionTargets,
                    model: nn.Module) -> DiffusionTargets:
    """The round's targets with the dynamic condition: F~ recomputed under prompts + c_i = h_k(x_i) of the
    model this client just received (same basis, same H~: NDCR's target stays fixed, as the paper wants)."""
    c, o, train = ctx.cfg, ctx.cfg.options, ctx.shard.train
    extractor = extractor_for(ctx)
    prompts, _ = T.prompts_for(c.dataset, list(ctx.shard.info.class_names), o.labels)
    prior = extractor.prior
    offsets = T.condition_offsets(model, for_classifier(train.x, c), prior.cond_shape[1], T.token_norm(prior, prompts),
                                  o.dynamic_condition, derive_seed("feddifrc-condition", c.seed))
    F_ = T.conditioned_targets(extractor, targets.basis, train.x, prompts, offsets)
    return DiffusionTargets(F=F_, pos=targets.pos, H=targets.H, basis=targets.basis)


# ---- handlers ------------------------------------------------------------------------------------
def model_from_message(msg: Message, ctx: ClientContext[FedDifRCOptions]) -> nn.Module:
    model = feddifrc_classifier(ctx.cfg, ctx.shard.info.num_classes)
    return load_weights(model, msg.content.array_records[ARRAYS_KEY])


def handle_train(msg: Message, ctx: ClientContext[FedDifRCOptions]) -> RecordDict:
    cfg, o, shard = ctx.cfg, ctx.cfg.options, ctx.shard
    targets, seconds = client_targets(ctx)
    model = model_from_message(msg, ctx)
    if o.dynamic_condition > 0 and o.lambda_tdcl > 0:
        t0 = time.time()
        targets = dynamic_targets(ctx, targets, model)
        seconds += time.time() - t0
    reg = FedDifRCLoss(targets, o.lambda_tdcl, o.lambda_ndcr, o.tau, o.ndcr_form)
    stats = local_train(model, for_classifier(shard.train.x, cfg), shard.train.y, epochs=cfg.local_epochs, lr=cfg.lr,
                        batch=cfg.batch_size, seed=ctx.seed_for(round_of(msg)), device=ctx.device, extra_loss=reg)
    return train_reply(model, len(shard.train), {**{f"train_{k}": v for k, v in stats.items()},
                                                 **{f"train_{k}": v for k, v in reg.means().items()},
                                                 CACHE_BYTES: targets.nbytes, FEATURE_SECONDS: seconds})


def handle_evaluate(msg: Message, ctx: ClientContext[FedDifRCOptions]) -> RecordDict:
    return evaluate_reply(model_from_message(msg, ctx), ctx)


HANDLERS = {TRAIN.message_type: handle_train, EVALUATE.message_type: handle_evaluate}
