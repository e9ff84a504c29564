"""FedProx (Li et al., 2020): FedAvg's protocol; Flower's FedProx adds `proximal-mu` (PROXIMAL_MU_KEY)
to the train config, and the client adds (mu/2)||w - w_global||² to its objective."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.options import opt
from fedapp.protocols.classify import PHASES, TRAIN  # noqa: F401  (the same exchanges)


@dataclass(frozen=True)
class FedProxOptions:
    mu: float = opt(0.01, low=0.0, help="proximal coefficient mu")
