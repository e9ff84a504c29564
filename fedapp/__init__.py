"""fedapp: diffusion and flow-matching models meet federated learning, as a Flower app."""

import os
import sys
from typing import Any

# Ray warns (FutureWarning) at every start that it will stop setting CUDA_VISIBLE_DEVICES="" for actors
# given no GPU; opt in to that now, as its message says. Here, not in fedapp.simulation: `flwr run` imports
# the ClientApp (so this package) before it starts Ray, and Ray's processes inherit the variable. A client
# given no GPU then sees the machine's GPUs, and `device=auto` uses one; `device=cpu` keeps it off.
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")


def simulate(run_config: dict, num_clients: int, backend: dict | None = None, **kwargs: Any) -> dict:
    """Run a Ray simulation and return summary.json (see `fedapp.simulation.simulate`)."""
    from fedapp.simulation import simulate as _simulate

    return _simulate(run_config, num_clients, backend, **kwargs)


__all__ = ["simulate"]

if os.path.basename(sys.argv[0]) == "flwr-simulation":  # `flwr run`'s simulation, Ray's driver: before ray.init
    from fedapp.simulation import own_ray_under_flwr_run

    own_ray_under_flwr_run()  # a private Ray unless RAY_ADDRESS names a cluster
