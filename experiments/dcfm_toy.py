"""The DCFM paper's 2-D toy: a Gaussian mixture with a horizontal (left/right) and a vertical (down/up)
attribute, two clients, and the pair (right, up) on no client.

    python -m experiments dcfm-toy [--seeds 5] [--sweep 1,3,10,30 --sweep-seeds 3] [--out docs/results]
        # -> <out>/dcfm_toy.png, <out>/dcfm_toy.json

Client 0 holds (left, down) and (left, up); client 1 holds (left, down) and (right, down). Each method
is asked for (right, up); the figure shows where its samples land, and `mode_share` is the share of
samples within distance 1 of the missing mode's centre (2, 2), per seed and as mean ± std. `--sweep` runs
DCFM-A and -B at each lambda first (same seeds). lambda, the masks pi, routes per batch and route masking
default to the run config's (fedapp/protocols/dcfm.py), so the toy measures the defaults a run uses.
Not a federated run: a 2-D toy that calls the same code as the image experiment (clients/dcfm.py's expert
training, FedFlow's aggregate, variant A's round schedule, the server's replay buffer and student
distillation, DDM's router) on the MLP VectorVelocityNet.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from clients.dcfm import train_expert
from fedapp.models.compose import NULL, composite_field, generate, joint_field, mixture_composite
from fedapp.models.flow import VectorVelocityNet, sample_path
from fedapp.protocols.dcfm import DcfmOptions
from experiments.cli import common_args, pin_threads
from experiments.common import prog
from fedapp.results import atomic_write_json

CENTRE = 2.0  # modes at (±2, ±2)
SIGMA = 0.35
LEFT, RIGHT, DOWN, UP = 0, 1, 0, 1
CLIENT_PAIRS = {0: [(LEFT, DOWN), (LEFT, UP)], 1: [(LEFT, DOWN), (RIGHT, DOWN)]}
MISSING = (RIGHT, UP)
DEFAULTS = DcfmOptions()
LR, BATCH, SAMPLE_STEPS = 3e-3, 256, 50


def toy_data(pairs, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n points per (horizontal, vertical) pair: N(((2h-1) c, (2v-1) c), sigma^2 I)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor(pairs).repeat_interleave(n, 0)
    centre = (2 * y.float() - 1) * CENTRE
    return centre + SIGMA * torch.randn(len(y), 2, generator=g), y


def toy_net(seed: int) -> VectorVelocityNet:
    torch.manual_seed(seed)
    return VectorVelocityNet(dim=2, attribute_sizes=[2, 2], hidden=128, layers=3)


def counts_of(y: torch.Tensor) -> torch.Tensor:
    c = torch.zeros(2, 2)
    for a, b in y.tolist():
        c[a, b] += 1
    return c


def fedavg(models: list, num_examples: list[int]) -> dict:
    """FedFlow's aggregate, the strategy's own (strategies/fedflow.py fedavg_experts): the num-examples-weighted
    mean of the local models."""
    from flwr.app import ArrayRecord, MetricRecord

    from fedapp.protocols import NUM_EXAMPLES_KEY
    from strategies.fedflow import expert_upload, fedavg_experts

    uploads = [expert_upload(ArrayRecord(m.state_dict()), MetricRecord({NUM_EXAMPLES_KEY: n}))
               for m, n in zip(models, num_examples, strict=True)]
    return fedavg_experts(uploads).to_torch_state_dict()


def local_experts(data: dict, steps: int, lambda_ci: float, pi: tuple, seed: int, ci_batch: int = 0) -> dict:
    """Stage I: each client's expert with L_FM + lambda L_CI on its own data."""
    experts = {}
    for a in data:
        m = toy_net(seed)
        train_expert(m, *data[a], steps=steps, batch=BATCH, lr=LR, pi=pi, lambda_ci=lambda_ci, seed=seed + 10 + a,
                     ci_batch=ci_batch)
        experts[a] = m.requires_grad_(False)
    return experts


def peer_rounds(experts: dict, data: dict, counts: dict, *, rounds: int, peer_steps: int, lambda_ci: float,
                pi: tuple, routes_per_batch: int, route_mask: bool, seed: int, schedule: str = "allgather",
                ci_batch: int = 0) -> None:
    """Variant A: R rounds of L_FM + lambda L_peerCI, each expert against frozen copies of the others, in the
    strategy's schedule (strategies/dcfm.py peer_round_groups): all from the round's start (allgather) or,
    sequential, the peers already retrained this round."""
    from strategies.dcfm import peer_round_groups

    for r in range(rounds):
        for group in peer_round_groups(sorted(experts), schedule):
            frozen = {a: copy.deepcopy(e) for a, e in experts.items()}
            for a in group:
                e = experts[a].requires_grad_(True)
                train_expert(e, *data[a], steps=peer_steps, batch=BATCH, lr=LR, pi=pi, lambda_ci=lambda_ci,
                             seed=seed + 20 + 10 * r + a, peers={b: f for b, f in frozen.items() if b != a},
                             self_index=a, peer_counts=counts, routes_per_batch=routes_per_batch,
                             route_mask=route_mask, ci_batch=ci_batch)
                e.requires_grad_(False)


@torch.no_grad()
def uncond_gap(experts: dict, data: dict, seed: int) -> float:
    """How far the experts' unconditional fields v^(a)(x_t, t, ∅) are apart, relative to their size:
    mean_a ||v^(a) - mean_b v^(b)||^2 / mean_a ||v^(a)||^2 at x_t on the linear paths of the union of
    the clients' data (where eq. 13's routes with r_0 = a peer compare them)."""
    g = torch.Generator().manual_seed(seed)
    x1 = torch.cat([x for x, _ in data.values()])
    x0 = torch.randn(x1.shape, generator=g)
    t = torch.rand(len(x1), generator=g)
    x_t, null = sample_path(x0, x1, t), torch.full((len(x1), 2), NULL)
    v = torch.stack([e(x_t, t, null) for e in experts.values()])
    return float((v - v.mean(0)).pow(2).sum(-1).mean() / v.pow(2).sum(-1).mean())


def mode_share(x: torch.Tensor, pair: tuple[int, int] = MISSING) -> float:
    """The share of samples within distance 1 of `pair`'s mode centre (default: the missing mode)."""
    centre = (2 * torch.tensor(pair).float() - 1) * CENTRE
    return float(((x - centre).norm(dim=1) < 1.0).float().mean())


SEEN = sorted({p for pairs in CLIENT_PAIRS.values() for p in pairs})


def seen_share(field_of, sample) -> float:
    """How well a model learnt the pairs some client holds: the mean over SEEN of the share of its samples of
    the pair that land in that pair's mode (the toy's reader of seen pairs, as the image table's
    seen-pair composition accuracy)."""
    return statistics.fmean(mode_share(sample(field_of(pair)), pair) for pair in SEEN)


def run_toy(steps: int = 400, fl_rounds: int = 20, distill_steps: int = 800, rounds: int = 2, peer_steps: int = 200,
            n: int = 256, lambda_ci: float = DEFAULTS.lambda_ci, pi: tuple = DEFAULTS.pi,
            routes_per_batch: int = DEFAULTS.routes_per_batch, route_mask: bool = DEFAULTS.route_mask,
            replay: str = DEFAULTS.replay, peer_schedule: str = DEFAULTS.peer_schedule,
            ci_batch: int = DEFAULTS.ci_batch, a_sampler: str = DEFAULTS.a_sampler, router_steps: int = 400,
            samples: int = 512, seed: int = 0, methods: tuple = ("fedflow", "dcfm-b")) -> dict:
    """FedFlow, DDM, DCFM-A and DCFM-B (those in `methods`) on the two clients; each samples (right, up)."""
    from strategies.dcfm import distill_student, replay_buffer
    from strategies.fedflow import routed_field, train_router

    torch.manual_seed(seed)
    data = {a: toy_data(p, n, seed + a) for a, p in CLIENT_PAIRS.items()}
    counts = {a: counts_of(data[a][1]).long() for a in data}
    want = torch.tensor([MISSING]).repeat(samples, 1)
    out, extra, glob = {}, {}, None
    sample = lambda field: generate(field, (samples, 2), SAMPLE_STEPS, seed + 7, clip=None)  # noqa: E731
    if "fedflow" in methods:  # FedAvg over one conditional flow (masked L_FM, no CI), joint-label sampling
        glob = toy_net(seed)
        for r in range(fl_rounds):
            local = []
            for a in data:
                m = copy.deepcopy(glob)
                train_expert(m, *data[a], steps=max(1, steps // fl_rounds), batch=BATCH, lr=LR, pi=pi,
                             lambda_ci=0.0, seed=seed + 100 * r + a)
                local.append(m)
            glob.load_state_dict(fedavg(local, [len(data[a][0]) for a in data]))
        out["fedflow"] = sample(joint_field(glob, want))
    if "ddm" in methods:  # experts without CI + a router (x_t, t) -> expert from their own samples
        plain = local_experts(data, steps, 0.0, pi, seed)
        ids = sorted(plain)
        router = train_router([plain[a] for a in ids], [counts[a] for a in ids], (2,), steps=router_steps,
                              batch=BATCH, lr=LR, sample_steps=SAMPLE_STEPS, seed=seed + 9, clip=2 * CENTRE + 1)
        out["ddm"] = sample(routed_field([plain[a] for a in ids], router, want))
    if not {"dcfm-a", "dcfm-b"} & set(methods):
        return finish(out, data, extra, glob, sample)
    experts = local_experts(data, steps, lambda_ci, pi, seed, ci_batch)
    if "dcfm-b" in methods:  # replay paths of the frozen teachers -> student (eq. 17)
        buf = replay_buffer(experts, counts, (2,), paths=256, steps=10, seed=seed + 1, mode=replay,
                            route_mask=route_mask)
        student = toy_net(seed)
        distill_student(student, buf, steps=distill_steps, batch=BATCH, lr=LR, pi=pi, lambda_ci=lambda_ci,
                        seed=seed + 2, ci_batch=ci_batch)
        out["dcfm-b"] = sample(composite_field(student, want))
    if "dcfm-a" in methods:  # R rounds of L_peerCI against frozen copies, then the experts' composite
        extra["uncond_gap_stage1"] = uncond_gap(experts, data, seed + 3)
        peer_rounds(experts, data, counts, rounds=rounds, peer_steps=peer_steps, lambda_ci=lambda_ci, pi=pi,
                    routes_per_batch=routes_per_batch, route_mask=route_mask, seed=seed, schedule=peer_schedule,
                    ci_batch=ci_batch)
        extra["uncond_gap"] = uncond_gap(experts, data, seed + 3)
        ids = sorted(experts)
        routes = torch.Generator().manual_seed(seed + 8) if a_sampler == "routed" else None
        out["dcfm-a"] = sample(mixture_composite([experts[a] for a in ids], [counts[a] for a in ids], want,
                                                 route_mask, routes))
    return finish(out, data, extra, glob, sample)


def finish(out: dict, data: dict, extra: dict, fedflow, sample) -> dict:
    """run_toy's result; FedFlow's seen-pair share (the toy's convergence reading) is sampled last, so no
    method's draws move."""
    if fedflow is not None:
        extra["fedflow_seen_share"] = seen_share(
            lambda pair: joint_field(fedflow, torch.tensor([pair]).repeat(len(out["fedflow"]), 1)), sample)
    return {"samples": out, "mode_share": {k: mode_share(v) for k, v in out.items()}, "data": data, **extra}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(res["samples"]), figsize=(4 * (1 + len(res["samples"])), 4))
    for a, (x, _) in res["data"].items():
        axes[0].scatter(x[:, 0], x[:, 1], s=3, label=f"client {a}")
    axes[0].set_title("client data; (right, up) on no client")
    axes[0].legend(loc="lower right")
    for ax, (name, x) in zip(axes[1:], res["samples"].items()):
        ax.scatter(x[:, 0], x[:, 1], s=3, c="C3")
        ax.set_title(f"{name}: (right, up) -> {100 * res['mode_share'][name]:.0f}% in the mode")
    for ax in axes:
        ax.add_patch(plt.Circle((CENTRE, CENTRE), 1.0, fill=False, ls="--", color="k"))
        ax.set_xlim(-4, 4), ax.set_ylim(-4, 4), ax.set_aspect("equal")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


METHODS = ("fedflow", "ddm", "dcfm-a", "dcfm-b")


def mean_std(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def over_seeds(seeds: list[int], methods: tuple, **settings) -> tuple[dict, dict]:
    """run_toy for each seed: per-method shares per seed and mean ± std (and A's unconditional gap);
    also the first seed's result for the figure."""
    per: dict[str, list[float]] = {}
    first = None
    for s in seeds:
        res = run_toy(seed=s, methods=methods, **settings)
        first = first or res
        for k, v in res["mode_share"].items():
            per.setdefault(k, []).append(v)
        for k in ("uncond_gap_stage1", "uncond_gap", "fedflow_seen_share"):
            if k in res:
                per.setdefault(k, []).append(res[k])
    return {k: {"per_seed": v, **mean_std(v)} for k, v in per.items()}, first


def floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be comma-separated numbers") from None


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 1")
    return int(text)


def parse(argv: list[str]) -> argparse.Namespace:
    """Every argument is checked here, before anything runs or is written (--help exits here too)."""
    shared = common_args(out="docs/results", threads=1, helps={"out": "folder for dcfm_toy.png and dcfm_toy.json"})
    p = argparse.ArgumentParser(prog=prog("dcfm-toy"), description=__doc__.split("\n")[0], parents=[shared])
    p.add_argument("--steps", type=positive, default=400, help="Stage I steps per expert (fedflow: over all rounds)")
    p.add_argument("--fl-rounds", type=positive, default=20, help="fedflow's FedAvg rounds")
    p.add_argument("--distill-steps", type=positive, default=800, help="DCFM-B: student steps")
    p.add_argument("--rounds", type=positive, default=2, help="DCFM-A: peer-CI rounds")
    p.add_argument("--peer-steps", type=positive, default=200, help="DCFM-A: steps per expert per round")
    p.add_argument("--points", type=positive, default=256, help="points per (horizontal, vertical) pair and client")
    p.add_argument("--lambda-ci", type=float, default=DEFAULTS.lambda_ci, help="lambda of every CI penalty")
    p.add_argument("--pi", type=floats, default=list(DEFAULTS.pi), help="pi_full,pi_marg,pi_uncond of every mask")
    p.add_argument("--routes-per-batch", type=positive, default=DEFAULTS.routes_per_batch)
    p.add_argument("--ci-batch", type=int, default=DEFAULTS.ci_batch,
                   help=f"samples of each minibatch ({BATCH}) the CI terms are estimated on (0: all)")
    p.add_argument("--route-mask", choices=("true", "false"), default=str(DEFAULTS.route_mask).lower())
    p.add_argument("--peer-schedule", choices=("allgather", "sequential"), default=DEFAULTS.peer_schedule)
    p.add_argument("--replay", choices=("teacher", "composite"), default=DEFAULTS.replay, help="DCFM-B's replay paths")
    p.add_argument("--a-sampler", choices=("expected", "routed"), default=DEFAULTS.a_sampler,
                   help="DCFM-A's sampler: routes in expectation or one drawn a sample")
    p.add_argument("--samples", type=positive, default=512, help="samples of (right, up) per method")
    p.add_argument("--seeds", type=positive, default=5, help="seeds 0..N-1")
    p.add_argument("--sweep", type=floats, default=[], help="lambdas to run DCFM-A and -B at first, e.g. 1,3,10,30")
    p.add_argument("--sweep-seeds", type=positive, default=3, help="seeds 0..N-1 of the sweep")
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    a = p.parse_args(argv)
    a.methods = tuple(a.methods.split(","))
    bad = [m for m in a.methods if m not in METHODS]
    if bad:
        p.error(f"--methods={','.join(bad)}: must be among {','.join(METHODS)}")
    if len(a.pi) != 3 or min(a.pi) < 0 or sum(a.pi) <= 0:
        p.error(f"--pi={a.pi}: must be three numbers >= 0 with a positive sum")
    if a.ci_batch < 0:
        p.error(f"--ci-batch={a.ci_batch}: must be >= 0 (0: the whole minibatch)")
    if a.lambda_ci < 0 or any(v < 0 for v in a.sweep):
        p.error(f"--lambda-ci / --sweep: must be >= 0 (got {a.lambda_ci}, {a.sweep})")
    return a


def paired_with_fedflow(table: dict) -> dict:
    """Same-seed differences of each method's missing-mode share against FedFlow's (the paper's baseline),
    experiments.common.paired_difference, keyed as the other tables' `paired`:
    {"<method> - fedflow": {mean, std, n, favour, per_seed}}."""
    from experiments.common import paired_difference

    base = dict(enumerate(table["fedflow"]["per_seed"]))
    return {f"{m} - fedflow": paired_difference(dict(enumerate(table[m]["per_seed"])), base, higher_is_better=True)
            for m in METHODS if m != "fedflow" and m in table}


def toy_verdict(table: dict) -> dict:
    """Converged when FedFlow, the paper's baseline, puts >= 90 % of its samples of every seed's seen pairs in
    their modes (experiments.common.generative_verdict on fedflow_seen_share, all seeds)."""
    from experiments.common import all_converged, generative_verdict

    return all_converged([generative_verdict(v) for v in table.get("fedflow_seen_share", {}).get("per_seed", [])])


def main(argv: list[str]) -> None:
    a = parse(argv)
    pin_threads(a.threads)
    t0 = time.time()
    settings = dict(steps=a.steps, fl_rounds=a.fl_rounds, distill_steps=a.distill_steps, rounds=a.rounds,
                    peer_steps=a.peer_steps, n=a.points, pi=tuple(a.pi), routes_per_batch=a.routes_per_batch,
                    route_mask=a.route_mask == "true", replay=a.replay, peer_schedule=a.peer_schedule,
                    samples=a.samples, ci_batch=a.ci_batch, a_sampler=a.a_sampler)
    seeds = list(range(a.seeds))
    sweep = {}
    for lam in a.sweep:
        sweep[str(lam)], _ = over_seeds(list(range(a.sweep_seeds)), ("dcfm-a", "dcfm-b"), lambda_ci=lam, **settings)
        print(f"lambda {lam}: "
              + ", ".join(f"{k} {v['mean']:.3f} ± {v['std']:.3f}" for k, v in sweep[str(lam)].items()),
              flush=True)
    table, first = over_seeds(seeds, a.methods, lambda_ci=a.lambda_ci, **settings)
    out = Path(a.out)
    plot(first, out / "dcfm_toy.png")
    info = {"mode_share": table, "verdict": toy_verdict(table),
            "paired": paired_with_fedflow(table) if "fedflow" in table else {}, "sweep": sweep,
            "seconds": round(time.time() - t0, 1),
            "settings": {**settings, "lambda_ci": a.lambda_ci, "seeds": seeds, "methods": list(a.methods),
                         "sweep_seeds": a.sweep_seeds}}
    atomic_write_json(out / "dcfm_toy.json", info)
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
