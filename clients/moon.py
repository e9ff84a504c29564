"""MOON client (Li, He & Song, CVPR 2021): local SGD with the model-contrastive loss

    l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )

z = g(embedding(x)) of the model being trained, z_glob of the global model received this round
(frozen), z_prev of this client's local model after its previous round (frozen, kept in the node's
Flower Context.state). L = L_CE + mu · l_con. In a client's first round there is no previous model:
MOON's code then uses the global model as z_prev, which makes l_con the constant log 2 with zero
gradient, so the term is simply skipped.
"""

from __future__ import annotations

import copy

import torch
from flwr.app import ArrayRecord, Message, RecordDict
from torch import nn
from torch.nn import functional as F

from clients.classify import evaluate_reply, local_train, round_of, train_reply
from fedapp.client_context import ClientContext
from fedapp.data import for_classifier
from fedapp.models.classifier import build_classifier
from fedapp.protocols import ARRAYS_KEY, EVALUATE
from fedapp.protocols.moon import STATE_PREV_MODEL, TRAIN, MoonOptions
from fedapp.protocols.weights import load_weights


def moon_contrastive(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """l_con, batch mean: cross-entropy of [sim(z, z_glob), sim(z, z_prev)]/tau with target 0 (cosine sim)."""
    logits = torch.stack([F.cosine_similarity(z, z_glob, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)], 1)
    return F.cross_entropy(logits / tau, torch.zeros(len(z), dtype=torch.long, device=z.device))


class MoonLoss:
    """extra_loss for clients.classify.local_train: mu · l_con on the forward pass just made."""

    def __init__(self, global_model: nn.Module, prev_model: nn.Module | None, mu: float, tau: float):
        self.global_model, self.prev_model, self.mu, self.tau = global_model, prev_model, mu, tau
        self.total, self.n = 0.0, 0

    @torch.no_grad()
    def _z(self, model: nn.Module, xb: torch.Tensor) -> torch.Tensor:
        return model.project(model.embed(xb))

    def __call__(self, model: nn.Module, xb: torch.Tensor, yb: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        z = model.project(model.embedding)
        if self.prev_model is None or self.mu == 0:
            return z.new_zeros(())
        l_con = moon_contrastive(z, self._z(self.global_model, xb), self._z(self.prev_model, xb), self.tau)
        self.total += l_con.item() * len(idx)
        self.n += len(idx)
        return self.mu * l_con

    def mean(self) -> float:
        return self.total / max(self.n, 1)


def frozen(model: nn.Module) -> nn.Module:
    return model.eval().requires_grad_(False)


def build_model(ctx: ClientContext[MoonOptions]) -> nn.Module:
    return build_classifier(ctx.cfg.model, ctx.shard.info.num_classes, proj_dim=ctx.cfg.options.proj_dim)


def previous_model(ctx: ClientContext[MoonOptions]) -> nn.Module | None:
    """The client's last local model from Context.state, or None in its first round."""
    if ctx.state is None or STATE_PREV_MODEL not in ctx.state.array_records:
        return None
    model = build_model(ctx)
    model.load_state_dict(ctx.state.array_records[STATE_PREV_MODEL].to_torch_state_dict())
    return frozen(model.to(ctx.device))


def model_from_message(msg: Message, ctx: ClientContext[MoonOptions]) -> nn.Module:
    return load_weights(build_model(ctx), msg.content.array_records[ARRAYS_KEY])


def handle_train(msg: Message, ctx: ClientContext[MoonOptions]) -> RecordDict:
    cfg, o, shard = ctx.cfg, ctx.cfg.options, ctx.shard
    model = model_from_message(msg, ctx)
    reg = MoonLoss(frozen(copy.deepcopy(model).to(ctx.device)), previous_model(ctx), o.mu, o.tau)
    stats = local_train(model, for_classifier(shard.train.x, cfg), shard.train.y, epochs=cfg.local_epochs, lr=cfg.lr,
                        batch=cfg.batch_size, seed=ctx.seed_for(round_of(msg)), device=ctx.device, extra_loss=reg)
    if ctx.state is not None:
        ctx.state[STATE_PREV_MODEL] = ArrayRecord(model.cpu().state_dict())  # z_prev of the next round
    return train_reply(model, len(shard.train), {**{f"train_{k}": v for k, v in stats.items()},
                                                 "train_con": reg.mean()})


def handle_evaluate(msg: Message, ctx: ClientContext[MoonOptions]) -> RecordDict:
    return evaluate_reply(model_from_message(msg, ctx), ctx)


HANDLERS = {TRAIN.message_type: handle_train, EVALUATE.message_type: handle_evaluate}
