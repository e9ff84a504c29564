"""MOON (Li, He & Song, CVPR 2021): FedAvg whose clients add the model-contrastive loss

    L = L_CE + mu · l_con,
    l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )

on the projection z of the local model, z_glob of the received global model and z_prev of the
client's previous local model (kept in the node's Flower Context.state; clients/moon.py).
Server side: FedAvg, over a classifier with a projection head.
"""

from __future__ import annotations

from fedapp.models.classifier import build_classifier
from fedapp.protocols import moon as P
from fedapp.server import ServerRun
from strategies.fedavg import FedAvgStrategy


class MoonStrategy(FedAvgStrategy):
    train_phase = P.TRAIN  # FedAvg's, with the train_con metric
    run: ServerRun[P.MoonOptions]

    def build_model(self):
        cfg = self.run.cfg
        return build_classifier(cfg.model, self.server_data().info.num_classes, proj_dim=cfg.options.proj_dim)
