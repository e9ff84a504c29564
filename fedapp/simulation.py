"""Python API: run a Ray simulation of a run config and return its summary."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import os
import sys

from fedapp.config import all_defaults, check_data, normalize_keys, parse_run_config


def _keep_ray_on_loopback() -> None:
    """Ray on Linux resolves 127.0.0.1 to the machine's routable address unless its
    "cluster" mode is off; off, every Ray process binds to the loopback interface."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read by Ray at import
    if "ray._private.ray_constants" in sys.modules:  # Ray already imported in this process
        sys.modules["ray._private.ray_constants"].ENABLE_RAY_CLUSTER = False


def simulate(run_config: Mapping[str, Any], num_clients: int, backend: dict | None = None,
             client_mods: list | None = None) -> dict[str, Any]:
    """Run `run_config` (flat keys, as in pyproject.toml; missing keys take their defaults)
    on `num_clients` virtual SuperNodes with Flower's Ray backend; return summary.json.

    `backend` is Flower's backend config, e.g. {"client_resources": {"num_cpus": 1,
    "num_gpus": 0.25}}; Ray binds to 127.0.0.1 and keeps its files in a temp dir.
    `client_mods` are Flower client mods (tests use one to inject failures).
    """
    _keep_ray_on_loopback()
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fedapp.client_app import make_client_app
    from fedapp.server_app import run_server

    flat = {**all_defaults(), **normalize_keys(run_config)}
    cfg = parse_run_config(flat)  # user errors surface here, before Ray starts
    check_data(cfg, num_clients)
    flat["run-name"] = cfg.resolved_run_name
    run_dir = Path(cfg.out_dir) / flat["run-name"]

    server = ServerApp()

    @server.main()
    def _main(grid, context) -> None:
        run_server(grid, flat)

    backend = dict(backend or {})
    init_args = dict(backend.get("init_args", {}))
    init_args.setdefault("_node_ip_address", "127.0.0.1")
    ray_tmp = None
    if "_temp_dir" not in init_args:
        ray_tmp = init_args["_temp_dir"] = tempfile.mkdtemp(prefix="fedapp-ray-")
    init_args.setdefault("include_dashboard", False)
    init_args.setdefault("logging_level", "warning")
    backend["init_args"] = init_args
    backend.setdefault("client_resources", {"num_cpus": 1, "num_gpus": 0.0})
    try:
        run_simulation(server_app=server, client_app=make_client_app(client_mods),
                       num_supernodes=num_clients, backend_config=backend)
    finally:
        if ray_tmp:  # Ray has shut down: its session files are no longer needed
            shutil.rmtree(ray_tmp, ignore_errors=True)
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise RuntimeError(f"the simulation ended without writing {summary_path}; see the log above")
    return json.loads(summary_path.read_text())
