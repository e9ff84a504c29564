"""FedProx (Li et al., 2020): FedAvg plus a proximal term (mu/2)||w - w_global||² in the local
objective. Flower's FedProx puts `proximal-mu` in every train message; the client's shared loop
(`clients.classify.local_train`) adds the term."""

from __future__ import annotations

from flwr.serverapp.strategy import FedProx

from fedapp.protocols.fedprox import FedProxOptions
from fedapp.server import ServerRun
from strategies.fedavg import FedAvgStrategy


class FedProxStrategy(FedAvgStrategy, FedProx):
    run: ServerRun[FedProxOptions]

    def __init__(self, run: ServerRun[FedProxOptions]):
        super().__init__(run, proximal_mu=run.cfg.options.mu)
