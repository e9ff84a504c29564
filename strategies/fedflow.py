"""DCFM's baselines on the same velocity net, data, evaluation and metering (strategies/flow.py) and the
same protocol (fedapp/protocols/dcfm.py):

- `fedflow`: FedAvg over one flow-matching model (masked L_FM, no CI penalty) on Flower's own round loop,
  `num-server-rounds` rounds of `dcfm.fl-local-steps` local steps; sampled with the joint label v(x_t, y).
  2T model transfers.
- `ddm`: local experts (masked L_FM, no CI) plus a router (x_t, t) -> expert trained on the server from
  the experts' own synthetic paths (each expert's samples of the pairs it trained on, drawn by its pair
  counts); velocity sum_a softmax(router(x_t, t))_a v^(a)(x_t, y). Each client gets the N - 1 peer experts
  and the router back: N model transfers (+ the small router).
- `local-only-flow`: each client's expert alone (masked L_FM, no CI); each answers an equal share of the
  requests with its joint label. Uploads only for the evaluation (1 transfer). Named `-flow` because
  `local-only` is the PFDM (diffusion) baseline's name in the registry.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from torch import nn
from torch.nn import functional as F

from fedapp.models.compose import joint_field
from fedapp.models.flow import euler, sample_path
from fedapp.protocols import ARRAYS_KEY, METRICS_KEY, NUM_EXAMPLES_KEY
from fedapp.protocols import dcfm as P
from fedapp.server import RoundStrategy, ServerRun
from fedapp.server.checkpoint import save_model
from strategies.dcfm import seen_pairs
from strategies.flow import FlowEvaluation, FlowStrategy, FlowTask, log

HOLDER_PROBE = 256  # seen-pair paths that measure DDM's router (router_holder_weight); a diagnostic, no sample kept


def expert_upload(expert: ArrayRecord, metrics: MetricRecord, arrays_key: str = ARRAYS_KEY) -> RecordDict:
    """What FedFlow's aggregation takes of one upload: the expert alone (Flower averages every ArrayRecord of
    a RecordDict and expects exactly one) and its metrics, whose num-examples weighs it."""
    return RecordDict({arrays_key: expert, METRICS_KEY: metrics})


def fedavg_experts(uploads: list[RecordDict], weighted_by_key: str = NUM_EXAMPLES_KEY) -> ArrayRecord:
    """FedFlow's global model: Flower's num-examples-weighted mean (aggregate_arrayrecords) of the uploaded
    experts (expert_upload); the strategy's round and the 2-D toy (experiments/dcfm_toy.py) alike."""
    return aggregate_arrayrecords(uploads, weighted_by_key)


class FedFlowStrategy(RoundStrategy):
    """FedAvg over one velocity net on Flower's own round loop; the shared evaluation at the end (no
    evaluate round: the global model is scored once, on the server, after the last round)."""

    train_phase = P.TRAIN
    run: ServerRun[P.DcfmOptions]

    def __init__(self, run: ServerRun[P.DcfmOptions]):
        super().__init__(run)
        self.uploads = 0  # valid uploads of the last round: the summary's num_experts

    # -- Flower hooks -------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid) -> Iterable[Message]:
        """Flower's messages (the global model, the run config with the round) plus the phase record:
        lambda = 0 (plain masked L_FM) and dcfm.fl-local-steps local steps."""
        messages = list(super().configure_train(server_round, arrays, config, grid))
        phase = P.phase_record(0.0, steps=self.run.cfg.options.fl_local_steps)
        for m in messages:
            m.content[P.PHASE_KEY] = phase
        return messages

    def validate_train(self, content: RecordDict) -> str | None:
        return self.task.validate(content)

    def aggregate_valid(self, server_round: int, kept: list[Message]):
        """Flower's num-examples-weighted mean of the valid uploads' experts.

        A reply carries the expert and its pair counts (the train phase's schema, checked by
        validate_expert); Flower averages every ArrayRecord of a reply and expects exactly one, so only
        the expert and the metrics go to its aggregation."""
        self.uploads = len(kept)
        models = [expert_upload(r.content.array_records[P.EXPERT_KEY], r.content.metric_records[METRICS_KEY],
                                self.arrayrecord_key) for r in kept]
        return (fedavg_experts(models, self.weighted_by_key),
                self.train_metrics_aggr_fn(models, self.weighted_by_key))

    # -- fedapp -------------------------------------------------------------------------
    def execute(self, grid) -> dict[str, Any]:
        cfg = self.run.cfg
        nodes = sorted(grid.get_node_ids())
        self.task = FlowTask(self.run, self.server_data(len(nodes)))
        initial = ArrayRecord(self.task.new_model().state_dict())
        with self.run.phase("fedavg"):
            result = self.run_rounds(grid, initial)
        global_model = self.task.load(result.arrays.to_torch_state_dict())
        save_model(self.run.out, global_model.state_dict())
        return FlowEvaluation(self.run, self.task).finish(lambda y, part: joint_field(global_model, y),
                                                          {"rounds": cfg.num_server_rounds}, num_experts=self.uploads)


class Router(nn.Module):
    """DDM's router p(a | x_t, t): a small CNN on the image with t as an extra channel, or (vector=True,
    the 2-D toy) an MLP on (x_t, t)."""

    def __init__(self, channels: int, experts: int, width: int = 32, vector: bool = False):
        super().__init__()
        self.vector = vector
        if vector:
            self.net = nn.Sequential(nn.Linear(channels + 1, 4 * width), nn.SiLU(), nn.Linear(4 * width, 4 * width),
                                     nn.SiLU(), nn.Linear(4 * width, experts))
            return
        self.net = nn.Sequential(
            nn.Conv2d(channels + 1, width, 3, padding=1), nn.SiLU(), nn.Conv2d(width, width, 3, padding=1, stride=2),
            nn.SiLU(), nn.Conv2d(width, width, 3, padding=1), nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(width, experts))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if self.vector:
            return self.net(torch.cat([x, t[:, None]], 1))
        tt = t.view(-1, 1, 1, 1).expand(-1, 1, *x.shape[2:])
        return self.net(torch.cat([x, tt], 1))


def train_router(experts: list, counts: list[torch.Tensor], shape: tuple[int, ...], *, steps: int, batch: int,
                 lr: float, sample_steps: int, seed: int, device: str = "cpu", per_expert: int = 64,
                 clip: float = 1.0) -> Router:
    """Samples x1 of each expert's learned data distribution, noised on the path x_t = t x1 + (1 - t) x0 and
    labelled with the expert's index: a data-free (x_t, t) -> expert classifier. An expert's distribution is
    the mixture of its conditionals over the pairs it trained on (`counts`, its pair counts n_a(y_1, y_2)):
    y ~ n_a, x1 from its own ODE under y. Not its unconditional output: with the default pi_full = 1 a plain
    expert never trains the null label, so its null-label samples are not its data (a router trained on them
    left DDM at 26 % seen-pair accuracy on 16 px colored-mnist: docs/dcfm.md). Samples are clipped to
    [-clip, clip] (images: [-1, 1]; the 2-D toy passes its own range)."""
    g = torch.Generator().manual_seed(seed)
    xs, labels = [], []
    for a, (e, n) in enumerate(zip(experts, counts, strict=True)):
        y = seen_pairs(n, per_expert, g).to(device)
        x0 = torch.randn((per_expert, *shape), generator=g).to(device)
        xs.append(euler(joint_field(e, y), x0, steps=sample_steps).clamp(-clip, clip))
        labels.append(torch.full((per_expert,), a, dtype=torch.long))
    x1, lab = torch.cat(xs), torch.cat(labels).to(device)
    router = Router(shape[0], len(experts), vector=len(shape) == 1).to(device)
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


def routed_field(experts: list, router: Router, y: torch.Tensor,
                 watch: Callable[[torch.Tensor], None] | None = None) -> Callable:
    """v(x_t, y) = sum_a p(a | x_t, t) v^(a)(x_t, t, y); `watch`, if given, sees each step's weights p."""
    def field(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        p = router(x, t).softmax(1)
        if watch is not None:
            watch(p)
        return sum(p[:, a].view(-1, *[1] * (x.ndim - 1)) * e(x, t, y) for a, e in enumerate(experts))
    return field


def router_holder_weight(experts: list, router: Router, counts: list[torch.Tensor], shape: tuple[int, ...], *,
                         n: int, sample_steps: int, seed: int, device: str = "cpu") -> dict[str, float]:
    """How much of the router's weight goes to the experts that trained on the asked pair, along DDM's own ODE
    for seen pairs (each seen pair equally likely, as the evaluation asks them): sum over holders a of
    p(a | x_t, t), averaged over the samples, at every Euler step. Returns its mean over the steps and its value
    at the last step. 1 = always a holder; a router blind to y can only guess near t = 0, so the mean shows how
    much of each path the non-holders' velocities steer."""
    g = torch.Generator().manual_seed(seed)
    seen = (sum(counts) > 0).long()
    y = seen_pairs(seen, n, g)
    holds = torch.stack([c[y[:, 0], y[:, 1]] > 0 for c in counts], 1).float().to(device)
    y = y.to(device)
    steps = []
    field = routed_field(experts, router, y, watch=lambda p: steps.append(float((p * holds).sum(1).mean())))
    euler(field, torch.randn((n, *shape), generator=g).to(device), steps=sample_steps)
    return {"router_holder_weight": sum(steps) / len(steps), "router_holder_weight_end": steps[-1]}


class DdmStrategy(FlowStrategy):
    def sampler(self, y: torch.Tensor, part: int) -> Callable:
        return routed_field([self.experts[a] for a in sorted(self.experts)], self.router, y)

    def execute(self, grid) -> dict[str, Any]:
        nodes = self.setup(grid)
        self.stage_one(grid, nodes, self.opts.lambda_ci if self.opts.ddm_ci else 0.0)  # DDM+L: DCFM's Stage I
        ids, recs = self.frozen()
        experts, counts = [self.experts[a] for a in ids], [self.counts[a] for a in ids]
        with self.run.phase("router"):
            self.router = train_router(experts, counts, self.task.shape, steps=self.opts.router_steps,
                                       batch=self.run.cfg.batch_size, lr=self.opts.lr,
                                       sample_steps=self.opts.sample_steps, seed=self.run.cfg.seed + 9,
                                       device=self.run.device)
        holder = router_holder_weight(experts, self.router, counts, self.task.shape, n=HOLDER_PROBE,
                                      sample_steps=self.opts.sample_steps, seed=self.run.cfg.seed + 10,
                                      device=self.run.device)
        log.info("ddm: router weight on the asked pair's holders %.3f along the path, %.3f at its last step",
                 holder["router_holder_weight"], holder["router_holder_weight_end"])
        router = ArrayRecord({k: v.cpu() for k, v in self.router.state_dict().items()})
        pid_of = {n: p for p, n in self.node_of.items()}

        def ensemble(node: int) -> dict[str, Any]:  # the N - 1 peers and the router: the ensemble on every client
            return {P.ROUTER_KEY: router, **{f"{P.PEER_PREFIX}{a}": recs[a] for a in ids if a != pid_of[node]}}

        self.exchange(grid, P.RECEIVE, sorted(pid_of), ensemble)
        return self.finish({"router_steps": self.opts.router_steps, **holder})


class LocalOnlyFlowStrategy(FlowStrategy):
    def parts(self) -> int:
        return len(self.experts)

    def sampler(self, y: torch.Tensor, part: int) -> Callable:
        return joint_field(self.experts[sorted(self.experts)[part]], y)

    def execute(self, grid) -> dict[str, Any]:
        self.stage_one(grid, self.setup(grid), 0.0)  # plain masked L_FM; uploaded for the evaluation only
        return self.finish({})
