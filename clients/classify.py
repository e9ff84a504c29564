"""Client side of classification baselines (FedAvg, FedProx): local SGD and evaluation.

`local_train` takes an optional `extra_loss(model, xb, yb, idx) -> loss` so regularised
methods (MOON, FedDifRC) reuse the loop instead of copying it.
"""

from __future__ import annotations

from typing import Callable

import torch
from flwr.app import Message, MetricRecord, RecordDict
from torch import nn
from torch.nn import functional as F

from fedapp.client_context import ClientContext
from fedapp.data import for_classifier
from fedapp.models.classifier import build_classifier, minibatches
from fedapp.protocols import (ACCURACY_KEY, ARRAYS_KEY, EVALUATE, LOSS_KEY, METRICS_KEY, NUM_EXAMPLES_KEY,
                              PROXIMAL_MU_KEY, ROUND_KEY, RUN_KEY)
from fedapp.protocols.classify import TRAIN
from fedapp.protocols.weights import load_weights, weights_record

ExtraLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def proximal_term(model: nn.Module, global_params: list[torch.Tensor]) -> torch.Tensor:
    """FedProx: (mu/2)·||w - w_global||² without the mu/2 factor."""
    return sum(((p - g) ** 2).sum() for p, g in zip(model.parameters(), global_params))


def local_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, lr: float,
                batch: int, seed: int, device: str = "cpu", prox_mu: float = 0.0,
                extra_loss: ExtraLoss | None = None) -> dict[str, float]:
    """Local SGD (momentum 0.9) on (x, y); returns the mean losses of the last epoch."""
    model.to(device).train()
    global_params = [p.detach().clone() for p in model.parameters()] if prox_mu > 0 else None
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(seed)
    stats = {"loss": 0.0, "ce": 0.0}
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        totals, n = {"loss": 0.0, "ce": 0.0}, 0
        for idx in minibatches(perm, batch, model):
            xb, yb = x[idx].to(device), y[idx].to(device)
            ce = F.cross_entropy(model(xb), yb)
            loss = ce
            if global_params is not None:
                loss = loss + 0.5 * prox_mu * proximal_term(model, global_params)
            if extra_loss is not None:
                loss = loss + extra_loss(model, xb, yb, idx)
            opt.zero_grad()
            loss.backward()
            opt.step()
            totals["loss"] += loss.item() * len(idx)
            totals["ce"] += ce.item() * len(idx)
            n += len(idx)
        stats = {k: v / max(n, 1) for k, v in totals.items()}
    return stats


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: str = "cpu",
             batch: int = 256) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of `model` on (x, y)."""
    model.to(device).eval()
    loss, correct = 0.0, 0
    for i in range(0, len(x), batch):
        xb, yb = x[i : i + batch].to(device), y[i : i + batch].to(device)
        logits = model(xb)
        loss += F.cross_entropy(logits, yb, reduction="sum").item()
        correct += (logits.argmax(1) == yb).sum().item()
    n = max(len(x), 1)
    return loss / n, correct / n


def model_from_message(msg: Message, ctx: ClientContext) -> nn.Module:
    """The classifier named by the run config, loaded with the server's (packed) weights."""
    model = build_classifier(ctx.cfg.model, ctx.shard.info.num_classes)
    return load_weights(model, msg.content.array_records[ARRAYS_KEY])


def round_of(msg: Message) -> int:
    """The server round Flower's loop stamps on the train config (0 outside its rounds)."""
    return int(msg.content.config_records[RUN_KEY].get(ROUND_KEY, 0))


def train_reply(model: nn.Module, num_examples: int, metrics: dict[str, float]) -> RecordDict:
    """FedAvg's train reply: the local weights (packed) and the sample weight with the training metrics."""
    return RecordDict({ARRAYS_KEY: weights_record(model.state_dict()),
                       METRICS_KEY: MetricRecord({NUM_EXAMPLES_KEY: num_examples, **metrics})})


def evaluate_reply(model: nn.Module, ctx: ClientContext) -> RecordDict:
    """The evaluate reply: the model's loss and accuracy on this client's real test split."""
    loss, acc = evaluate(model, for_classifier(ctx.shard.test.x, ctx.cfg), ctx.shard.test.y, device=ctx.device)
    return RecordDict({METRICS_KEY: MetricRecord({NUM_EXAMPLES_KEY: len(ctx.shard.test), LOSS_KEY: loss,
                                                  ACCURACY_KEY: acc})})


def handle_train(msg: Message, ctx: ClientContext, extra_loss: ExtraLoss | None = None) -> RecordDict:
    cfg, shard = ctx.cfg, ctx.shard
    model = model_from_message(msg, ctx)
    mu = float(msg.content.config_records[RUN_KEY].get(PROXIMAL_MU_KEY, 0.0))
    x = for_classifier(shard.train.x, cfg)  # at classifier-size
    stats = local_train(model, x, shard.train.y, epochs=cfg.local_epochs, lr=cfg.lr,
                        batch=cfg.batch_size, seed=ctx.seed_for(round_of(msg)), device=ctx.device,
                        prox_mu=mu, extra_loss=extra_loss)
    return train_reply(model, len(shard.train), {f"train_{k}": v for k, v in stats.items()})


def handle_evaluate(msg: Message, ctx: ClientContext) -> RecordDict:
    return evaluate_reply(model_from_message(msg, ctx), ctx)


HANDLERS = {TRAIN.message_type: handle_train, EVALUATE.message_type: handle_evaluate}
