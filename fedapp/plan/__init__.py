"""What a run will cost, before anything runs: `python -m fedapp.plan <preset.toml | key=value ...>`.

From the run config alone (parsed as a run parses it), the data's shards (a pure function of the config)
and the prior's config files (no weights, no network), the plan counts
  - model evaluations: UNet calls of the server's synthesis (CFG doubling and Z-sampling's extra calls,
    as fedapp.models.prior.samplers counts them), the clients' condition learning, feature passes and
    FedDifRC's targets, PFDM's and DCFM's training steps and samplers; classifier steps per round;
  - images synthesised;
  - bytes down and up per client and in total, as the metered grid counts them (comm.json);
  - the prior's parameters and memory at the run's resolution and batch (meta device: nothing allocated);
and projects the wall time on this machine from a micro-benchmark of the real modules at the run's shapes
(random weights). Modules: inputs (config), facts (data), arch (prior configs), ledger + counts +
generative (work), comm + traffic (bytes), footprint (memory, FLOPs), modules + bench (timing), report.
"""

from __future__ import annotations

from typing import Any, Mapping

from fedapp.plan import counts, generative, traffic
from fedapp.plan.ledger import Ledger

# method -> (work counter, byte counter); a method registered later with one of these strategies plans as it
COUNTERS = {
    "fedavg": (counts.round_based, "rounds"), "fedprox": (counts.round_based, "rounds"),
    "moon": (counts.moon, "rounds"), "feddifrc": (counts.feddifrc, "rounds"),
    "centralized": (counts.centralized, "oneshot"), "espresso": (counts.espresso, "espresso"),
    "prompts": (counts.espresso, "espresso"), "class-embed": (counts.espresso, "espresso"),
    "pfdm": (generative.pfdm, "pfdm"), "local-only": (generative.local_only, "pfdm"),
    "fedavg-ddpm": (generative.fedavg_ddpm, "pfdm"), "dpdm": (generative.fedavg_ddpm, "pfdm"),
    "centralized-ddpm": (generative.centralized_ddpm, "pfdm"), "dcfm": (generative.dcfm, "dcfm"),
    "fedflow": (generative.fedflow, "dcfm"), "ddm": (generative.flow_experts, "dcfm"),
    "local-only-flow": (generative.flow_experts, "dcfm"),
}


def counters_of(method: str):
    """(work counter, byte counter) of a method: its own, or that of a known method with its strategy."""
    from fedapp import registry
    from fedapp.options import ConfigError

    if method in COUNTERS:
        return COUNTERS[method]
    strategy = registry.METHODS[method].strategy
    for known, pair in COUNTERS.items():
        if known in registry.METHODS and registry.METHODS[known].strategy == strategy:
            return pair
    raise ConfigError(f"method={method!r}: the planner has no cost model for its strategy {strategy}")


def count_work(cfg, facts, arch) -> Ledger:
    led = Ledger()
    counters_of(cfg.method)[0](led, cfg, facts, arch)
    return led


def count_bytes(cfg, facts, arch, modules: dict):
    from fedapp.plan.comm import Comm

    comm = Comm(cfg, facts)
    kind = counters_of(cfg.method)[1]
    if kind == "rounds":
        traffic.rounds(comm, cfg, facts, modules)
    elif kind == "oneshot":
        traffic.oneshot_evaluate(comm, cfg, modules)
    elif kind == "espresso":
        traffic.espresso(comm, cfg, facts, modules, arch)
    elif kind == "pfdm":
        traffic.pfdm_family(comm, cfg, facts, modules)
    else:
        traffic.dcfm_family(comm, cfg, facts, modules)
    return comm


def make_plan(run_config: Mapping[str, Any], num_clients: int | None = None, *, bench: bool = True,
              budget: float = 1.0, full: bool = False, assume: tuple[int, int] | None = None) -> dict[str, Any]:
    """The plan of a flat run config (missing keys take their defaults) on `num_clients` clients (default:
    4, the quickstart's, or min-clients when larger), as a JSON-ready dict (report.py prints it). `assume`
    = (classes, training images per client): plan without reading the data (facts.assumed_facts)."""
    from fedapp.plan.facts import data_facts
    from fedapp.plan.inputs import resolve
    from fedapp.plan.report import assemble

    cfg, arch = resolve(run_config)
    n = num_clients or max(4, cfg.min_clients)
    facts = data_facts(cfg, n, assume)
    led = count_work(cfg, facts, arch)
    comm = count_bytes(cfg, facts, arch, led.modules)
    timer = None
    if bench:
        from fedapp.plan.bench import Bench

        timer = Bench(led.modules, cfg.torch_device(), budget=budget, full=full)
    return assemble(cfg, facts, arch, led, comm, timer)
