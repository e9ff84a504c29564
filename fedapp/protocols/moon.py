"""MOON (Li, He & Song, CVPR 2021): FedAvg's protocol over a classifier with a projection head; each
client keeps its previous local model in its node state (z_prev of the model-contrastive loss)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.options import opt
from fedapp.protocols import EVALUATE
from fedapp.protocols.classify import train_phase

TRAIN_CON = "train_con"  # train metric: the mean model-contrastive loss l_con
TRAIN = train_phase(TRAIN_CON)  # FedAvg's exchanges; the train reply also reports l_con
PHASES = (TRAIN, EVALUATE)
STATE_PREV_MODEL = "moon.prev-model"  # node state (Context.state), never sent: the last local model


@dataclass(frozen=True)
class MoonOptions:
    # The paper's best mu is 5 on CIFAR-10 and 1 on CIFAR-100/Tiny-ImageNet; 1 is its code's default.
    mu: float = opt(1.0, low=0.0, help="weight of the model-contrastive loss l_con")
    tau: float = opt(0.5, low=0.0, low_open=True, help="temperature of l_con (paper: 0.5)")
    proj_dim: int = opt(128, low=1, help="output dimension of the projection head (paper: 256)")
