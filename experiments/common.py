"""What several experiments share: log levels, `--set key=value` overrides, the argparse prog name."""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from typing import Any, Iterable, Iterator


def prog(name: str) -> str:
    """argparse's prog for `python -m experiments <name>`."""
    return f"python -m experiments {name}"


def quiet_logs() -> None:
    """Warnings only from Flower's and fedapp's loggers (a line per round, phase and client otherwise)."""
    for name in ("flwr", "fedapp"):
        lg = logging.getLogger(name)
        if name == "fedapp" and not lg.handlers:  # run_server would add an INFO handler
            lg.addHandler(logging.StreamHandler())
            lg.propagate = False
        lg.setLevel(logging.WARNING)


def parse_set(items: list[str]) -> dict[str, Any]:
    """`key=value` run-config overrides; a value is read as JSON when it parses (numbers, true/false)."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


BACKENDS = ("inprocess", "ray")


@contextmanager
def config_errors_exit() -> Iterator[None]:
    """A user error in a run config (ConfigError) ends the command with its one line, no traceback."""
    from fedapp.config import ConfigError

    try:
        yield
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None


def check_configs(configs: list[dict[str, Any]], num_clients: int) -> None:
    """Every run config of the grid resolves (keys, values, data for `num_clients`), or the command
    stops with the one-line error before it has written anything."""
    from fedapp.simulation import resolve_run_config

    with config_errors_exit():
        for flat in configs:
            resolve_run_config(flat, num_clients)


def run(flat: dict[str, Any], num_clients: int, backend: str, reply_cache: Any = None) -> dict[str, Any]:
    """One run of the grid; returns its summary.json. backend "ray": `fedapp.simulate` (Flower's Ray
    simulation); "inprocess": `fedapp.simulation.simulate_in_process` (same server, clients served in
    this process, replies reused through `reply_cache` where the clients' work repeats)."""
    if backend == "ray":
        import fedapp

        return fedapp.simulate(flat, num_clients=num_clients)
    from fedapp.simulation import simulate_in_process

    return simulate_in_process(flat, num_clients, reply_cache=reply_cache)


def kid_cell(row: dict[str, Any], key: str) -> str:
    """A table cell "KID ± std over subsets" (fedapp.metrics.kernel_distance); n/a for rows measured before KID."""
    return f"{row[key]:.3f}±{row[key + '_std']:.3f}" if key in row else "n/a"


def over_seeds(rows: list[dict[str, Any]], keys: Iterable[str]) -> dict[str, float]:
    """The runs of one table cell (one per seed): for each key, the mean over the runs that report it as a
    number, `<key>_seed_std` its std (ddof 0; not `_std`, which a KID already uses for its subsets), and
    `<key>_runs` where fewer runs than the cell's have it (a figure added after some were measured)."""
    import statistics

    out: dict[str, float] = {}
    for k in keys:
        vals = [r[k] for r in rows if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
        if vals:
            out[k] = statistics.fmean(vals)
            out[k + "_seed_std"] = statistics.pstdev(vals)
            if len(vals) < len(rows):
                out[k + "_runs"] = len(vals)
    return out
