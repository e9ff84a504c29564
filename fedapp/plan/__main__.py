"""`python -m fedapp.plan [preset.toml] [key=value ...] [--num-clients N] [--json]`: what a run will cost."""

from __future__ import annotations

import argparse
import json
import os
import sys


def offline_unless_reachable(timeout: float = 1.5) -> None:
    """Hugging Face offline for this process when its endpoint does not answer (one HTTP request), before
    anything imports huggingface_hub or datasets: a dataset id the plan cannot read then fails at once, not
    after the hub client's retries (fedapp.preflight.hub_reachable's test, without importing the hub client)."""
    import urllib.error
    import urllib.request

    if os.environ.get("HF_HUB_OFFLINE"):
        return
    url = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:  # an answer, if not a 200
        return
    except (OSError, ValueError):
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedapp.plan", description=(
        "Before anything runs: model evaluations, images synthesised, bytes per client, the prior's size and "
        "memory, and a wall time projected from a micro-benchmark of the run's modules on this machine."))
    ap.add_argument("config", nargs="*", help="a preset .toml (run-config keys, as flwr run --run-config takes) "
                                              "and/or key=value pairs over it; nothing: the default experiment")
    ap.add_argument("--num-clients", type=int, default=None, help="clients (default 4, or min-clients if larger)")
    ap.add_argument("--json", action="store_true", help="the plan as JSON on stdout")
    ap.add_argument("--no-bench", action="store_true", help="counts and bytes only, no timing")
    ap.add_argument("--budget", type=float, default=1.0,
                    help="seconds one timed call may take; larger calls are timed at fewer rows and scaled")
    ap.add_argument("--full", action="store_true", help="time the real prior modules even when a CPU would take "
                                                        "long (default: a narrowed stand-in scaled by FLOPs)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the benchmark (default: torch's)")
    ap.add_argument("--classes", type=int, default=None, help="with --images-per-client: plan without reading the "
                                                              "data (a hub dataset offline), assuming this many "
                                                              "classes, balanced")
    ap.add_argument("--images-per-client", type=int, default=None, help="training images a client (with --classes)")
    a = ap.parse_args(argv)
    offline_unless_reachable()
    from fedapp.options import ConfigError

    try:
        if a.num_clients is not None and a.num_clients < 1:
            raise ConfigError(f"--num-clients={a.num_clients}: must be >= 1")
        assume = None
        if (a.classes is None) != (a.images_per_client is None) or min(a.classes or 1, a.images_per_client or 1) < 1:
            raise ConfigError(f"--classes={a.classes} --images-per-client={a.images_per_client}: give both, each >= 1")
        if a.classes is not None:
            assume = (a.classes, a.images_per_client)
        if a.threads:
            import torch

            torch.set_num_threads(a.threads)
        from fedapp.plan import make_plan
        from fedapp.plan.inputs import read_run_config

        plan = make_plan(read_run_config(a.config), a.num_clients, bench=not a.no_bench, budget=a.budget,
                         full=a.full, assume=assume)
    except (ConfigError, OSError) as err:  # OSError: a classifier or backbone id that cannot load here
        print(f"fedapp.plan: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(plan, indent=1, default=str))
    else:
        from fedapp.plan.report import table

        print(table(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
