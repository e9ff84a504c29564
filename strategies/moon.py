"""MOON (Li, He & Song, CVPR 2021): FedAvg whose clients add the model-contrastive loss

    L = L_CE + mu · l_con,   l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )

on the projection z of the local model, z_glob of the received global model and z_prev of the
client's previous local model (kept in the node's Flower Context.state; clients/moon.py).
Server side: FedAvg, over a classifier with a projection head.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import opt
from fedapp.models.classifier import build_classifier
from strategies.fedavg import FedAvgStrategy


@dataclass(frozen=True)
class MoonOptions:
    # The paper's best mu is 5 on CIFAR-10 and 1 on CIFAR-100/Tiny-ImageNet; 1 is its code's default.
    mu: float = opt(1.0, low=0.0, help="weight of the model-contrastive loss l_con")
    tau: float = opt(0.5, low=0.0, low_open=True, help="temperature of l_con (paper: 0.5)")
    proj_dim: int = opt(128, low=1, help="output dimension of the projection head (paper: 256)")


class MoonStrategy(FedAvgStrategy):
    def build_model(self):
        cfg = self.run.cfg
        return build_classifier(cfg.model, self.server_data().info.num_classes, proj_dim=cfg.options.proj_dim)
