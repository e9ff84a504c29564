"""Clients of PFDM's generation baselines (options under `pfdm.*`; protocol: fedapp/protocols/pfdm.py):

- `local-only` (`query.sample`): a class-conditional DDPM on the client's own data only (no
  collaboration, nothing uploaded but the evaluation samples); `pfdm.local-steps` steps.
- `fedavg-ddpm` (`train`): FedAvg over one DDPM (FedDM-like, not private): from the global weights,
  ceil(pfdm.local-steps / num-server-rounds) steps per round, then the weights go back.

Each denoiser keeps a train state in a named run (fedapp.models.checkpoints.run_train_state): a restarted
fedavg-ddpm run replays its finished rounds from their states (the same global models, no step taken) and
continues the cut one where it was saved.
"""

from __future__ import annotations

import math

import torch
from flwr.app import ArrayRecord, Message, RecordDict

from clients.classify import round_of, train_reply
from fedapp.client_context import ClientContext
from fedapp.models.checkpoints import TrainState, run_train_state
from fedapp.models.ddpm import DDPM, build_ddpm, train_ddpm
from fedapp.protocols import ARRAYS_KEY
from fedapp.protocols import pfdm as P
from fedapp.protocols.weights import load_weights


def train_local_ddpm(x, y, o, image_size: int, num_classes: int, seed: int, device: str = "cpu",
                     state: TrainState | None = None):
    torch.manual_seed(seed)
    model = build_ddpm(image_size, num_classes, flag=False, channels=o.channels)
    loss = train_ddpm(model, x, y, steps=o.local_steps, batch=o.batch, lr=o.lr, seed=seed, device=device,
                      ema=o.ema, p_uncond=o.p_uncond, state=state)
    return model.cpu(), loss


def handle_local_sample(msg: Message, ctx: ClientContext[P.PFDMOptions]) -> RecordDict:
    o, shard = ctx.cfg.options, ctx.shard
    state = run_train_state(ctx.cfg, f"client{ctx.partition_id}-local")
    model, _ = train_local_ddpm(shard.train.x, shard.train.y, o, ctx.cfg.image_size, shard.info.num_classes,
                                ctx.seed_for(1), ctx.device, state)
    y = torch.arange(o.samples) % shard.info.num_classes
    x = model.sample(len(y), y, steps=o.sample_steps, generator=torch.Generator().manual_seed(ctx.seed_for(3)))
    return RecordDict({P.SAMPLES_KEY: ArrayRecord({P.X: x, P.Y: y})})


def steps_per_round(o, rounds: int) -> int:
    """A client's pfdm.local-steps budget split over the FedAvg rounds."""
    return math.ceil(o.local_steps / rounds)


def global_ddpm(msg: Message, ctx: ClientContext[P.PFDMOptions]) -> tuple[int, DDPM]:
    """(round, the global class-conditional DDPM of the message) of a FedAvg-style DDPM round."""
    model = build_ddpm(ctx.cfg.image_size, ctx.shard.info.num_classes, flag=False, channels=ctx.cfg.options.channels)
    return round_of(msg), load_weights(model, msg.content.array_records[ARRAYS_KEY])


def handle_fedavg_train(msg: Message, ctx: ClientContext[P.PFDMOptions]) -> RecordDict:
    o, shard = ctx.cfg.options, ctx.shard
    rnd, model = global_ddpm(msg, ctx)
    loss = train_ddpm(model, shard.train.x, shard.train.y, steps=steps_per_round(o, ctx.cfg.num_server_rounds),
                      batch=o.batch, lr=o.lr, seed=ctx.seed_for(rnd), device=ctx.device, ema=o.ema,
                      p_uncond=o.p_uncond, state=run_train_state(ctx.cfg, f"client{ctx.partition_id}-round{rnd}"))
    return train_reply(model, len(shard.train), {P.TRAIN_LOSS_METRIC: loss})


HANDLERS = {P.LOCAL_SAMPLE.message_type: handle_local_sample, P.FEDAVG_TRAIN.message_type: handle_fedavg_train}
