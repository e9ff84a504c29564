"""DCFM's baselines on the same velocity net, data, evaluation and metering (strategies/dcfm.py):

- `fedflow`: FedAvg over one flow-matching model (masked L_FM, no CI penalty), `num-server-rounds` rounds
  of `dcfm.fl-local-steps` local steps; sampled with the joint label v(x_t, y). 2T model transfers.
- `ddm`: local experts (masked L_FM, no CI) plus a router (x_t, t) -> expert trained on the server from
  the experts' own synthetic paths; velocity sum_a softmax(router(x_t, t))_a v^(a)(x_t, y). Each client
  gets the N - 1 peer experts and the router back: N model transfers (+ the small router).
- `local-only-flow`: each client's expert alone (masked L_FM, no CI); each answers an equal share of the
  requests with its joint label. Uploads only for the evaluation (1 transfer). Named `-flow` because
  `local-only` is the PFDM (diffusion) baseline's name in the registry.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import nn
from torch.nn import functional as F

from fedapp.models.compose import PHASE_KEY, joint_field
from fedapp.models.flow import euler, sample_path
from strategies.base import RUN_KEY
from strategies.dcfm import FlowStrategy, tensors


class FedFlowStrategy(FlowStrategy):
    name = "fedflow"

    def sampler(self, y: torch.Tensor, part: int) -> Callable:
        return joint_field(self.global_model, y)

    def execute(self, grid) -> dict[str, Any]:
        nodes = self.setup(grid)
        model = self.new_model()
        t0 = time.time()
        for rnd in range(1, self.run.cfg.num_server_rounds + 1):
            rec = ArrayRecord({k: v.cpu() for k, v in model.state_dict().items()})
            conf = self.run_config_record(**{"server-round": rnd})
            phase = ConfigRecord({"lambda": 0.0, "steps": self.opts.fl_local_steps})
            self.experts, self.counts = {}, {}
            kept = self.keep_experts(self.send(grid, nodes, "train", lambda n: RecordDict(
                {RUN_KEY: conf, PHASE_KEY: phase, "arrays": rec})), "train")
            # FedAvg: sample-weighted mean of the valid uploads
            w = torch.tensor([float(r.content.metric_records["metrics"]["num-examples"]) for r in kept])
            states = [tensors(r.content.array_records["expert"]) for r in kept]
            avg = {k: sum(wi * s[k].float() for wi, s in zip(w / w.sum(), states)).to(states[0][k].dtype)
                   for k in states[0]}
            model.load_state_dict(avg)
        self.run.phase_seconds["fedavg"] = time.time() - t0
        self.global_model = model.to(self.run.device).eval().requires_grad_(False)
        return self.finish({"rounds": self.run.cfg.num_server_rounds})


class Router(nn.Module):
    """DDM's router p(a | x_t, t): a small CNN on the image with t as an extra channel."""

    def __init__(self, channels: int, experts: int, width: int = 32):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(channels + 1, width, 3, padding=1), nn.SiLU(), nn.Conv2d(width, width, 3, padding=1, stride=2),
            nn.SiLU(), nn.Conv2d(width, width, 3, padding=1), nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(width, experts))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        tt = t.view(-1, 1, 1, 1).expand(-1, 1, *x.shape[2:])
        return self.net(torch.cat([x, tt], 1))


def train_router(experts: list, shape: tuple[int, ...], *, steps: int, batch: int, lr: float, sample_steps: int,
                 seed: int, device: str = "cpu", per_expert: int = 64) -> Router:
    """Each expert's unconditional samples x1 (its own ODE), noised on the path x_t = t x1 + (1 - t) x0,
    labelled with the expert's index: a data-free (x_t, t) -> expert classifier."""
    g = torch.Generator().manual_seed(seed)
    xs, labels = [], []
    for a, e in enumerate(experts):
        null = torch.full((per_expert, 2), -1, dtype=torch.long, device=device)
        x0 = torch.randn((per_expert, *shape), generator=g).to(device)
        xs.append(euler(joint_field(e, null), x0, steps=sample_steps).clamp(-1, 1))
        labels.append(torch.full((per_expert,), a, dtype=torch.long))
    x1, lab = torch.cat(xs), torch.cat(labels).to(device)
    router = Router(shape[0], len(experts)).to(device)
    opt = torch.optim.AdamW(router.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randint(len(x1), (batch,), generator=g)
        t = torch.rand(batch, generator=g).to(device)
        x_t = sample_path(torch.randn(x1[idx].shape, generator=g).to(device), x1[idx], t)
        loss = F.cross_entropy(router(x_t, t), lab[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return router.eval().requires_grad_(False)


def routed_field(experts: list, router: Router, y: torch.Tensor) -> Callable:
    """v(x_t, y) = sum_a p(a | x_t, t) v^(a)(x_t, t, y)."""
    def field(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        p = router(x, t).softmax(1)
        return sum(p[:, a].view(-1, 1, 1, 1) * e(x, t, y) for a, e in enumerate(experts))
    return field


class DdmStrategy(FlowStrategy):
    name = "ddm"

    def sampler(self, y: torch.Tensor, part: int) -> Callable:
        return routed_field([self.experts[a] for a in sorted(self.experts)], self.router, y)

    def execute(self, grid) -> dict[str, Any]:
        nodes = self.setup(grid)
        self.stage_one(grid, nodes, 0.0)
        t0 = time.time()
        ids = sorted(self.experts)
        shape = (self.server.info.channels, self.run.cfg.image_size, self.run.cfg.image_size)
        self.router = train_router([self.experts[a] for a in ids], shape, steps=self.opts.router_steps,
                                   batch=self.run.cfg.batch_size, lr=self.opts.lr, sample_steps=self.opts.sample_steps,
                                   seed=self.run.cfg.seed + 9, device=self.run.device)
        self.run.phase_seconds["router"] = time.time() - t0
        recs = {a: ArrayRecord({k: v.cpu() for k, v in self.experts[a].state_dict().items()}) for a in ids}
        router_rec = ArrayRecord({k: v.cpu() for k, v in self.router.state_dict().items()})
        conf = self.run_config_record()
        pid_of = {n: p for p, n in self.node_of.items()}

        def content(node: int) -> RecordDict:  # the N - 1 peers and the router: the ensemble on every client
            rd = RecordDict({RUN_KEY: conf, "router": router_rec})
            for a in ids:
                if a != pid_of[node]:
                    rd[f"peer.{a}"] = recs[a]
            return rd

        self.send(grid, sorted(pid_of), "query.receive", content)
        return self.finish({"router_steps": self.opts.router_steps})


class LocalOnlyFlowStrategy(FlowStrategy):
    name = "local-only-flow"

    def parts(self) -> int:
        return len(self.experts)

    def sampler(self, y: torch.Tensor, part: int) -> Callable:
        return joint_field(self.experts[sorted(self.experts)[part]], y)

    def execute(self, grid) -> dict[str, Any]:
        self.stage_one(grid, self.setup(grid), 0.0)
        return self.finish({})
