"""DCFM (ICML 2026) client side, and the flow-matching baselines' (FedFlow, DDM, local-only-flow).

The equations (masks eq. 8, composite eq. 5, L_CI eq. 7, L_peerCI eqs. 12-13) are tensor functions in
fedapp/models/compose.py, shared with the server; here: the local training loop and the handlers.
Client functions take tensors and return tensors; the Flower handlers are at the bottom (protocol, record
keys: fedapp/protocols/dcfm.py).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fedapp.client_context import ClientContext
from fedapp.models.compose import (attribute_labels, build_velocity, ci_penalty, ci_sample, mask_labels,
                                   pair_counts, peer_ci_penalty, sample_route)
from fedapp.models.checkpoints import Checkpoints, OnCheckpoint
from fedapp.models.flow import VelocityNet, sample_path, target_velocity
from fedapp.progress import track
from fedapp.protocols import ARRAYS_KEY, METRICS_KEY, NUM_EXAMPLES_KEY, ROUND_KEY, RUN_KEY
from fedapp.protocols import dcfm as P

# ---- Stage I / variant A / baselines: one local loop ------------------------------------------------
def train_expert(model: VelocityNet, x: torch.Tensor, y: torch.Tensor, *, steps: int, batch: int, lr: float,
                 pi: tuple[float, float, float], lambda_ci: float, seed: int, device: str = "cpu",
                 peers: dict[int, Callable] | None = None, self_index: int = 0,
                 peer_counts: dict[int, torch.Tensor] | None = None, routes_per_batch: int = 1,
                 route_mask: bool = True, ci_batch: int = 0, checkpoints: Iterable[int] = (),
                 on_checkpoint: OnCheckpoint | None = None) -> dict[str, float]:
    """L = L_FM(y ⊙ m) + lambda * L_CI (Stage I, eq. 11), or + lambda * L_peerCI when peers are given
    (variant A: `routes_per_batch` routing vectors per step; `route_mask` leaves out routes to experts
    that never saw the value, judged by `peer_counts`). lambda_ci = 0 is plain masked conditional flow
    matching (the baselines). `ci_batch` > 0 estimates the CI term on that many of the minibatch's samples
    (ci_sample). on_checkpoint(k, model, L_FM) after step k of `checkpoints` (a budget sweep)."""
    gen = torch.Generator().manual_seed(seed)
    ckpt = Checkpoints(checkpoints, on_checkpoint)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ids = sorted({self_index, *(peers or {})})  # the experts a route may pick (a dropped peer is absent)
    sums = {"fm": 0.0, "ci": 0.0}
    # minutes a message at real sizes (2,000 steps ~10 min on one core): a progress line now and then
    for step in track(range(steps), "peer-CI steps" if peers else "expert steps", eta=True):
        idx = torch.randint(len(x), (min(batch, len(x)),), generator=gen)
        x1, yb = x[idx].to(device), y[idx].to(device)
        x0 = torch.randn(x1.shape, generator=gen).to(device)
        t = torch.rand(len(x1), generator=gen).to(device)
        x_t = sample_path(x0, x1, t)
        y_m = mask_labels(yb.cpu(), *pi, generator=gen).to(device)
        fm = (model(x_t, t, y_m) - target_velocity(x0, x1)).pow(2).mean()  # L_FM
        loss, ci = fm, torch.zeros(())
        if lambda_ci > 0:
            xc, tc, yc = ci_sample(ci_batch, x_t, t, yb)
            if peers:
                routes = [[ids[j] for j in sample_route(len(ids), yb.shape[1], ids.index(self_index), gen)]
                          for _ in range(routes_per_batch)]
                counts = (peer_counts or {}) if route_mask else None
                ci = peer_ci_penalty(model, peers, self_index, xc, tc, yc, routes, counts)
            else:
                ci = ci_penalty(model, xc, tc, yc)
            loss = fm + lambda_ci * ci
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sums["fm"] += fm.item()
        sums["ci"] += float(ci.detach())
        ckpt.step(step + 1, fm.item(), model, model)
    model.eval()
    return {k: v / max(steps, 1) for k, v in sums.items()}


# ---- Flower handlers --------------------------------------------------------------------------------
def _opts(ctx: ClientContext[P.DcfmOptions]) -> P.DcfmOptions:
    return ctx.cfg.options


def _local_data(ctx: ClientContext[P.DcfmOptions]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    shard = ctx.shard
    return shard.train.x.float(), attribute_labels(shard.train, P.ATTRS), P.attribute_sizes(shard.info)


def _net(ctx: ClientContext[P.DcfmOptions], sizes: list[int]) -> VelocityNet:
    """A velocity net of the run's width and label embedding, initialised from torch's current RNG."""
    opts = _opts(ctx)
    return build_velocity(ctx.cfg.image_size, sizes, opts.width, label_embedding=opts.label_embedding)


def _model(ctx: ClientContext[P.DcfmOptions], sizes: list[int]) -> VelocityNet:
    torch.manual_seed(ctx.cfg.seed)  # every client starts from the same initial weights
    return _net(ctx, sizes)


def _load(model: VelocityNet, rec: ArrayRecord) -> VelocityNet:
    model.load_state_dict(rec.to_torch_state_dict())
    return model.eval()


def _reply(model: VelocityNet, counts: torch.Tensor, stats: dict[str, float], n: int) -> RecordDict:
    return RecordDict({P.EXPERT_KEY: ArrayRecord(model.cpu().state_dict()),
                       P.COUNTS_KEY: ArrayRecord({P.PAIRS: counts}),
                       METRICS_KEY: MetricRecord({NUM_EXAMPLES_KEY: n, **{f"train_{k}": v for k, v in stats.items()}})})


def handle_train(msg: Message, ctx: ClientContext[P.DcfmOptions]) -> RecordDict:
    """Stage I (no arrays in the message: a fresh expert, L_FM + lambda L_CI) or one FedFlow local round
    (the global model in ARRAYS_KEY, plain masked L_FM). Uploads the model and the pair counts."""
    opts = _opts(ctx)
    x, y, sizes = _local_data(ctx)
    model = _model(ctx, sizes)
    conf = msg.content.config_records[RUN_KEY]
    rnd = int(conf.get(ROUND_KEY, 0))
    phase = msg.content.config_records.get(P.PHASE_KEY, {})  # what the server asks of this round
    lam = float(phase.get(P.LAMBDA, opts.lambda_ci))
    steps = int(phase.get(P.STEPS, opts.local_steps))
    if ARRAYS_KEY in msg.content.array_records:
        _load(model, msg.content.array_records[ARRAYS_KEY])
    stats = train_expert(model, x, y, steps=steps, batch=ctx.cfg.batch_size, lr=opts.lr,
                         pi=opts.pi, lambda_ci=lam, ci_batch=opts.ci_batch,
                         seed=ctx.seed_for(rnd, 1), device=ctx.device)
    if ctx.state is not None:
        ctx.state[P.STATE_EXPERT] = ArrayRecord(model.cpu().state_dict())
    return _reply(model, pair_counts(y, sizes), stats, len(x))


def handle_peer(msg: Message, ctx: ClientContext[P.DcfmOptions]) -> RecordDict:
    """Variant A, one round: train the own expert (kept in node state) with L_FM + lambda L_peerCI against
    the frozen peers of the allgather (P.PEER_PREFIX + pid ArrayRecords)."""
    opts = _opts(ctx)
    x, y, sizes = _local_data(ctx)
    own = _model(ctx, sizes)
    if ctx.state is None or P.STATE_EXPERT not in ctx.state.array_records:
        raise RuntimeError("dcfm variant A: no Stage I expert in this node's state (was `train` run first?)")
    _load(own, ctx.state.array_records[P.STATE_EXPERT])
    peers, counts = {}, {}
    for key, rec in msg.content.array_records.items():
        if key.startswith(P.PEER_PREFIX):
            pid = int(key[len(P.PEER_PREFIX):])
            peers[pid] = _load(_net(ctx, sizes), rec).to(ctx.device)
            for p in peers[pid].parameters():
                p.requires_grad_(False)
        elif key.startswith(P.PEER_COUNTS_PREFIX):
            counts[int(key[len(P.PEER_COUNTS_PREFIX):])] = torch.as_tensor(rec[P.PAIRS].numpy())
    counts[ctx.partition_id] = pair_counts(y, sizes)
    rnd = int(msg.content.config_records[RUN_KEY].get(ROUND_KEY, 0))
    stats = train_expert(own, x, y, steps=opts.peer_steps, batch=ctx.cfg.batch_size, lr=opts.lr,
                         pi=opts.pi, lambda_ci=opts.lambda_ci,
                         seed=ctx.seed_for(rnd, 2), device=ctx.device, peers=peers,
                         self_index=ctx.partition_id, peer_counts=counts,
                         routes_per_batch=opts.routes_per_batch, route_mask=opts.route_mask,
                         ci_batch=opts.ci_batch)
    ctx.state[P.STATE_EXPERT] = ArrayRecord(own.cpu().state_dict())
    return _reply(own, counts[ctx.partition_id], stats, len(x))


def handle_receive(msg: Message, ctx: ClientContext[P.DcfmOptions]) -> RecordDict:
    """Variant B's last message: the distilled student arrives; the client keeps it (no upload)."""
    if ctx.state is not None and ARRAYS_KEY in msg.content.array_records:
        ctx.state[P.STATE_STUDENT] = msg.content.array_records[ARRAYS_KEY]
    return RecordDict({METRICS_KEY: MetricRecord({P.RECEIVED: 1})})


HANDLERS = {P.TRAIN.message_type: handle_train, P.PEER.message_type: handle_peer,
            P.RECEIVE.message_type: handle_receive}
