"""The DCFM paper's 2-D toy: a Gaussian mixture with a horizontal (left/right) and a vertical (down/up)
attribute, two clients, and the pair (right, up) on no client.

    python -m experiments dcfm-toy [--out docs]        # -> <out>/dcfm_toy.png, <out>/dcfm_toy.json

Client 0 holds (left, down) and (left, up); client 1 holds (left, down) and (right, down). Each method
is asked for (right, up); the figure shows where its samples land, and `mode_share` is the share of
samples within distance 1 of the missing mode's centre (2, 2). Not a federated run: a 2-D toy that calls
the same math as the image experiment (clients/dcfm.py's expert training, the server's replay buffer,
teacher targets and student distillation) directly, on the MLP VelocityNet.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from clients.dcfm import train_expert
from fedapp.models.compose import composite_field, generate, joint_field, mixture_composite
from fedapp.models.flow import VelocityNet
from experiments.common import prog
from fedapp.results import atomic_write_json

CENTRE = 2.0  # modes at (±2, ±2)
SIGMA = 0.35
LEFT, RIGHT, DOWN, UP = 0, 1, 0, 1
CLIENT_PAIRS = {0: [(LEFT, DOWN), (LEFT, UP)], 1: [(LEFT, DOWN), (RIGHT, DOWN)]}
MISSING = (RIGHT, UP)
PI = (0.4, 0.4, 0.2)


def toy_data(pairs, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n points per (horizontal, vertical) pair: N(((2h-1) c, (2v-1) c), sigma^2 I)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor(pairs).repeat_interleave(n, 0)
    centre = (2 * y.float() - 1) * CENTRE
    return centre + SIGMA * torch.randn(len(y), 2, generator=g), y


def toy_net(seed: int) -> VelocityNet:
    torch.manual_seed(seed)
    return VelocityNet(dim=2, attribute_sizes=[2, 2], hidden=128, layers=3)


def counts_of(y: torch.Tensor) -> torch.Tensor:
    c = torch.zeros(2, 2)
    for a, b in y.tolist():
        c[a, b] += 1
    return c


def fedavg(models: list) -> dict:
    sd = [m.state_dict() for m in models]
    return {k: sum(s[k] for s in sd) / len(sd) for k in sd[0]}


def local_experts(data: dict, steps: int, lambda_ci: float, pi: tuple, seed: int) -> dict:
    """Stage I: each client's expert with L_FM + lambda L_CI on its own data."""
    experts = {}
    for a in data:
        m = toy_net(seed)
        train_expert(m, *data[a], steps=steps, batch=256, lr=3e-3, pi=pi, lambda_ci=lambda_ci, seed=seed + 10 + a)
        experts[a] = m.requires_grad_(False)
    return experts


def run_toy(steps: int = 400, fl_rounds: int = 20, distill_steps: int = 800, rounds: int = 2, peer_steps: int = 200,
            n: int = 256, lambda_ci: float = 1.0, lambda_student: float = 5.0, samples: int = 512, seed: int = 0,
            methods: tuple = ("fedflow", "dcfm-b")) -> dict:
    """FedFlow, DCFM-B (and DCFM-A if asked) on the two clients; each samples (right, up)."""
    from strategies.dcfm import distill_student, replay_buffer, teacher_targets

    torch.manual_seed(seed)
    data = {a: toy_data(p, n, seed + a) for a, p in CLIENT_PAIRS.items()}
    counts = {a: counts_of(data[a][1]).long() for a in data}
    want = torch.tensor([MISSING]).repeat(samples, 1)
    out = {}
    if "fedflow" in methods:  # FedAvg over one conditional flow (masked L_FM, no CI), joint-label sampling
        glob = toy_net(seed)
        for r in range(fl_rounds):
            local = []
            for a in data:
                m = copy.deepcopy(glob)
                train_expert(m, *data[a], steps=max(1, steps // fl_rounds), batch=256, lr=3e-3, pi=PI,
                             lambda_ci=0.0, seed=seed + 100 * r + a)
                local.append(m)
            glob.load_state_dict(fedavg(local))
        out["fedflow"] = generate(joint_field(glob, want), (samples, 2), 50, seed + 7, clip=None)
    experts = local_experts(data, steps, lambda_ci, PI, seed)
    if "dcfm-b" in methods:  # replay paths of the frozen teachers -> student with L_student + lambda L_studentCI
        buf = replay_buffer(experts, counts, (2,), paths=256, steps=10, seed=seed + 1)
        buf = teacher_targets(buf, [experts[a] for a in sorted(experts)], [counts[a] for a in sorted(experts)])
        student = toy_net(seed)
        distill_student(student, buf, steps=distill_steps, batch=256, lr=3e-3, pi=(1.0, 0.0, 0.0),
                        lambda_ci=lambda_student, seed=seed + 2)
        out["dcfm-b"] = generate(composite_field(student, want), (samples, 2), 50, seed + 7, clip=None)
    if "dcfm-a" in methods:  # R rounds of L_peerCI against frozen copies, then the experts' composite
        for r in range(rounds):
            frozen = {a: copy.deepcopy(e) for a, e in experts.items()}
            for a, e in experts.items():
                e.requires_grad_(True)
                train_expert(e, *data[a], steps=peer_steps, batch=256, lr=3e-3, pi=PI, lambda_ci=lambda_ci,
                             seed=seed + 20 + 10 * r + a, peers={b: f for b, f in frozen.items() if b != a},
                             self_index=a, peer_counts=counts)
                e.requires_grad_(False)
        ids = sorted(experts)
        out["dcfm-a"] = generate(mixture_composite([experts[a] for a in ids], [counts[a] for a in ids], want),
                                 (samples, 2), 50, seed + 7, clip=None)
    centre = (2 * torch.tensor(MISSING).float() - 1) * CENTRE
    share = {k: float(((v - centre).norm(dim=1) < 1.0).float().mean()) for k, v in out.items()}
    return {"samples": out, "mode_share": share, "data": data}


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


METHODS = ("fedflow", "dcfm-a", "dcfm-b")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog=prog("dcfm-toy"), description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400, help="Stage I steps per expert (fedflow: over all rounds)")
    p.add_argument("--fl-rounds", type=int, default=20, help="fedflow's FedAvg rounds")
    p.add_argument("--distill-steps", type=int, default=800, help="DCFM-B: student steps")
    p.add_argument("--rounds", type=int, default=2, help="DCFM-A: peer-CI rounds")
    p.add_argument("--peer-steps", type=int, default=200, help="DCFM-A: steps per expert per round")
    p.add_argument("--points", type=int, default=256, help="points per (horizontal, vertical) pair and client")
    p.add_argument("--lambda-ci", type=float, default=1.0)
    p.add_argument("--lambda-student", type=float, default=5.0)
    p.add_argument("--samples", type=int, default=512, help="samples of (right, up) per method")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--out", default="docs", help="folder for dcfm_toy.png and dcfm_toy.json")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    a = p.parse_args(argv)
    methods = tuple(a.methods.split(","))
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"--methods={','.join(bad)}: must be among {','.join(METHODS)}")
    torch.set_num_threads(a.threads)
    t0 = time.time()
    settings = dict(steps=a.steps, fl_rounds=a.fl_rounds, distill_steps=a.distill_steps, rounds=a.rounds,
                    peer_steps=a.peer_steps, n=a.points, lambda_ci=a.lambda_ci, lambda_student=a.lambda_student,
                    samples=a.samples, seed=a.seed, methods=methods)
    res = run_toy(**settings)
    out = Path(a.out)
    plot(res, out / "dcfm_toy.png")
    info = {"mode_share": res["mode_share"], "seconds": round(time.time() - t0, 1), "settings": settings}
    atomic_write_json(out / "dcfm_toy.json", info)
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
