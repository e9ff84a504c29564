"""PFDM client (CVPR 2026, Algorithm 1 and 2): a private denoiser that never leaves the client, a
local-DP upload, and two-stage sampling.

  private denoiser z_theta_m: a class-conditional DDPM on D_m, trained on unclipped (flag 0) and
      CLIP(x, C) (flag 1) copies of every image: the shared model only ever saw clipped data, so the
      flag lets sampling steer back to unclipped images (the paper's auxiliary condition); levels
      (0, t0] only unless pfdm.private-levels = all (PFDM never samples it above t0)
  upload D~_m: x~ = sqrt(abar_t0) CLIP(x, C) + sqrt(1 - abar_t0) z, with the labels (fedapp.privacy)
  sampling: shared z_w from T down to t0, then z_theta_m from t0 to 0 with the unclipped flag

Plain tensor functions first; the Flower handlers at the bottom only unpack and pack records
(protocol: fedapp/protocols/pfdm.py).
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fedapp.client_context import ClientContext
from fedapp.models.checkpoints import TrainState, kept_tensors, run_train_state
from fedapp.models.ddpm import DDPM, build_ddpm, shared_sample, split_steps, train_ddpm
from fedapp.privacy import clip_norm, privatize, resolve_t0
from fedapp.protocols import METRICS_KEY, NUM_EXAMPLES_KEY
from fedapp.protocols import pfdm as P

UNCLIPPED, CLIPPED = 0, 1   # values of the auxiliary flag


def private_training_set(x: torch.Tensor, y: torch.Tensor, clip: float):
    """(x, y, flag): every image twice, unclipped with flag 0 and CLIP(x, C) with flag 1."""
    xs = torch.cat([x, clip_norm(x, clip)])
    flags = torch.cat([torch.full((len(x),), UNCLIPPED), torch.full((len(x),), CLIPPED)])
    return xs, torch.cat([y, y]), flags


def private_levels(mode: str, t0: int, T: int) -> tuple[int, int]:
    """(lo, hi]: the levels the private denoiser trains on. below-t0: (0, t0], the only ones Algorithm 2
    samples it on; all: (0, T], which it also needs to sample alone from noise."""
    if mode not in P.PRIVATE_LEVELS:
        raise ValueError(f"pfdm.private-levels={mode!r}: must be one of {', '.join(P.PRIVATE_LEVELS)}")
    return (0, t0) if mode == "below-t0" else (0, T)


def train_private_denoiser(x: torch.Tensor, y: torch.Tensor, o, image_size: int, num_classes: int, t0: int,
                           seed: int, device: str = "cpu", levels: str | None = None,
                           state: TrainState | None = None) -> DDPM:
    """z_theta_m on clipped and unclipped data with the flag, over private_levels(levels or
    pfdm.private-levels, t0); `state`: continue from / save to that train state (train_ddpm)."""
    torch.manual_seed(seed)
    model = build_ddpm(image_size, num_classes, flag=True, channels=o.channels)
    xs, ys, flags = private_training_set(x, y, o.clip)
    train_ddpm(model, xs, ys, flags, steps=o.local_steps, batch=o.batch, lr=o.lr, seed=seed,
               ema=o.ema, p_uncond=o.p_uncond,
               t_range=private_levels(levels or o.private_levels, t0, model.T), device=device, state=state)
    return model.cpu()


def make_upload(x: torch.Tensor, y: torch.Tensor, clip: float, t0: int):
    """D~_m: (x~, y) with x~ = sqrt(abar_t0) CLIP(x, C) + sqrt(1 - abar_t0) z, in the order of x; z from the
    OS (fedapp.privacy.privatize), so no one who knows the run config can subtract it. Labels go in the clear."""
    return privatize(x, clip, t0), y.clone().long()


def balanced_labels(n: int, num_classes: int) -> torch.Tensor:
    return torch.arange(n) % num_classes


@torch.no_grad()
def personalised_sample(shared: DDPM, private: DDPM, y: torch.Tensor, t0: int, steps: int, seed: int,
                        shared_mode: str = "relative", handover: str = "ddim", clip: float = 10.0) -> torch.Tensor:
    """Algorithm 2: x_t0 ~ z_w (shared_sample), then x_0 ~ z_theta_m(t0 -> 0 | flag = unclipped)."""
    g = torch.Generator().manual_seed(seed)
    k_shared, k_private = split_steps(steps, t0, shared.T)
    x_t0 = shared_sample(shared, y, t0, shared_mode, k_shared, g, handover, clip)
    flag = torch.full((len(y),), UNCLIPPED)
    return private.sample(len(y), y, flag, t_start=t0, t_end=0, x_start=x_t0, steps=k_private, generator=g)


@torch.no_grad()
def private_only_sample(private: DDPM, y: torch.Tensor, steps: int, seed: int) -> torch.Tensor:
    """The private model alone, T -> 0 (the paper's fallback; here the non-collaborative reference)."""
    g = torch.Generator().manual_seed(seed)
    flag = torch.full((len(y),), UNCLIPPED)
    return private.sample(len(y), y, flag, steps=steps, generator=g)


# ---- Flower handlers ---------------------------------------------------------------------------------
def _train_private(ctx: ClientContext[P.PFDMOptions], t0: int, levels: str | None = None) -> DDPM:
    """The private denoiser (levels None) or its all-levels reference, each under its own train state."""
    o, shard = ctx.cfg.options, ctx.shard
    state = run_train_state(ctx.cfg, f"client{ctx.partition_id}-{'private' if levels is None else 'reference'}")
    return train_private_denoiser(shard.train.x, shard.train.y, o, ctx.cfg.image_size, shard.info.num_classes,
                                  t0, ctx.seed_for(1), ctx.device, levels, state)


def _private_model(ctx: ClientContext[P.PFDMOptions], t0: int) -> DDPM:
    """The private denoiser from Context.state; retrained (same seed, same weights) if the node restarted."""
    o, shard = ctx.cfg.options, ctx.shard
    if ctx.state is not None and P.STATE_PRIVATE in ctx.state.array_records:
        model = build_ddpm(ctx.cfg.image_size, shard.info.num_classes, flag=True, channels=o.channels)
        model.load_state_dict(ctx.state.array_records[P.STATE_PRIVATE].to_torch_state_dict())
        return model.eval()
    return _train_private(ctx, t0)


def _reference_model(ctx: ClientContext[P.PFDMOptions], private: DDPM, t0: int) -> DDPM:
    """The non-collaborative reference, sampled alone T -> 0: the private model itself when it learnt every
    level; else the same trainer, data, budget and seed over all levels (evaluation only, never uploaded)."""
    return private if ctx.cfg.options.private_levels == "all" else _train_private(ctx, t0, levels="all")


def handle_train(msg: Message, ctx: ClientContext[P.PFDMOptions]) -> RecordDict:
    """Phase 1: train z_theta_m (kept in Context.state), upload D~_m."""
    o, shard = ctx.cfg.options, ctx.shard
    t0 = resolve_t0(o.t0, o.epsilon, o.clip, o.delta, o.accountant)
    model = _train_private(ctx, t0)
    if ctx.state is not None:
        ctx.state[P.STATE_PRIVATE] = ArrayRecord(model.state_dict())
    # drawn once (from the OS): a restarted client sends the same release again, never a second one
    up = kept_tensors(ctx.cfg, f"client{ctx.partition_id}-upload",
                      lambda: dict(zip((P.X, P.Y), make_upload(shard.train.x, shard.train.y, o.clip, t0))))
    x_up, y_up = up[P.X], up[P.Y]
    return RecordDict({P.UPLOAD_KEY: ArrayRecord({P.X: x_up, P.Y: y_up}),
                       METRICS_KEY: MetricRecord({NUM_EXAMPLES_KEY: len(y_up), P.T0_METRIC: t0})})


def handle_sample(msg: Message, ctx: ClientContext[P.PFDMOptions]) -> RecordDict:
    """Phase 2: personalised samples (shared T -> t0, private t0 -> 0) and, for the comparison, private-only
    samples. Evaluation only: the server scores them; the protocol itself needs no reply here."""
    o, shard = ctx.cfg.options, ctx.shard
    t0 = resolve_t0(o.t0, o.epsilon, o.clip, o.delta, o.accountant)
    shared = build_ddpm(ctx.cfg.image_size, shard.info.num_classes, flag=False, channels=o.channels)
    shared.load_state_dict(msg.content.array_records[P.SHARED_KEY].to_torch_state_dict())
    private = _private_model(ctx, t0)
    y = balanced_labels(o.samples, shard.info.num_classes)
    x = personalised_sample(shared.eval(), private, y, t0, o.sample_steps, ctx.seed_for(3), o.shared,
                            o.handover, o.clip)
    x_alone = private_only_sample(_reference_model(ctx, private, t0), y, o.sample_steps, ctx.seed_for(3))
    return RecordDict({P.SAMPLES_KEY: ArrayRecord({P.X: x, P.Y: y, P.PRIVATE_ONLY: x_alone})})


HANDLERS = {P.TRAIN.message_type: handle_train, P.SAMPLE.message_type: handle_sample}
