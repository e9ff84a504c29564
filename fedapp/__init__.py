"""fedapp: diffusion and flow-matching models meet federated learning, as a Flower app."""

from typing import Any


def simulate(run_config: dict, num_clients: int, backend: dict | None = None, **kwargs: Any) -> dict:
    """Run a Ray simulation and return summary.json (see `fedapp.simulation.simulate`)."""
    from fedapp.simulation import simulate as _simulate

    return _simulate(run_config, num_clients, backend, **kwargs)


__all__ = ["simulate"]
