"""DCFM (ICML 2026, "Compositional Generative Modeling from Decentralized Data"): server side.

Protocol (clients/dcfm.py has the client side and the equations):
1. Stage I (`train`, no model down): every client trains a local expert v^(a)(x_t, t, y ⊙ m) with
   L_FM + lambda L_CI and uploads it with its pair counts n_a(y_1, y_2).
2. Variant A (`dcfm.variant = a`): R rounds (`dcfm.rounds`) of an allgather (`query.peer`): every client
   gets the N - 1 peer experts, trains its own with L_FM + lambda L_peerCI (peers frozen) and uploads it.
   Sampling: the composite velocity over all experts (fedapp.models.compose.mixture_composite).
   Variant B (`dcfm.variant = b`): the server distils the frozen experts into one student on synthetic
   replay paths x^_t (L_student, eq. 15) plus the student's own CI penalty (L_studentCI, eq. 16) and
   sends it back (`query.receive`): two model transfers per client. Sampling: the student's composite.
3. Evaluation on the server (strategies/flow.py, shared with the baselines): samples for every seen
   and every novel (digit, colour) pair, read by reference classifiers trained on real data.
Record keys, phases and upload validation: fedapp/protocols/dcfm.py.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from flwr.app import ArrayRecord

from fedapp.models.compose import ci_penalty, composite_field, mask_labels, mixture_composite
from fedapp.protocols import ARRAYS_KEY, ROUND_KEY
from fedapp.protocols import dcfm as P
from fedapp.server.checkpoint import save_model
from strategies.flow import FlowStrategy, timed


# ---- variant B: distillation into one student (eqs. 15-17) ---------------------------------------------
@torch.no_grad()
def replay_buffer(experts: dict[int, Any], counts: dict[int, torch.Tensor], shape: tuple[int, ...], *,
                  paths: int, steps: int, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Synthetic replay paths x^_t: Euler trajectories of each frozen teacher a under its own joint field,
    y drawn from its seen pairs ∝ n_a(y); teachers by their sample counts. Keeps every state with its t,
    y and the teacher's velocity (the L_student target of the full label)."""
    g = torch.Generator().manual_seed(seed)
    ids = sorted(experts)
    n = torch.stack([counts[a].sum() for a in ids]).double()
    who = torch.multinomial(n / n.sum(), paths, replacement=True, generator=g)
    xs, ts, ys, vs = [], [], [], []
    for j, a in enumerate(ids):
        m = int((who == j).sum())
        if m == 0:
            continue
        flat = counts[a].flatten().double()
        cell = torch.multinomial(flat / flat.sum(), m, replacement=True, generator=g)
        y = torch.stack([cell // counts[a].shape[1], cell % counts[a].shape[1]], 1).to(device)
        x = torch.randn((m, *shape), generator=g).to(device)
        for s in range(steps):
            t = torch.full((m,), s / steps, device=device)
            v = experts[a](x, t, y)
            xs.append(x), ts.append(t), ys.append(y), vs.append(v)
            x = x + v / steps
    return {"x": torch.cat(xs), "t": torch.cat(ts), "y": torch.cat(ys), "v_joint": torch.cat(vs)}


@torch.no_grad()
def teacher_targets(buf: dict[str, torch.Tensor], experts: list, counts: list[torch.Tensor],
                    batch: int = 256) -> dict[str, torch.Tensor]:
    """v-bar^(r) at every replay state for the unconditional and each marginal query: the count-weighted
    mixture over the frozen teachers (the routing vector r in expectation)."""
    v0s, vis = [], []
    for i in range(0, len(buf["x"]), batch):
        sl = slice(i, i + batch)
        _, v0, vi = mixture_composite(experts, counts, buf["y"][sl])(buf["x"][sl], buf["t"][sl], parts=True)
        v0s.append(v0), vis.append(torch.stack(vi, 1))
    return {**buf, "v_uncond": torch.cat(v0s), "v_marg": torch.cat(vis)}


def distill_student(student, buf: dict[str, torch.Tensor], *, steps: int, batch: int, lr: float,
                    pi: tuple[float, float, float], lambda_ci: float, seed: int, device: str = "cpu") -> dict:
    """L_DCFM-B = L_student + lambda L_studentCI (eq. 17):
    L_student = E || v_s(x^_t, t, y ⊙ m) - v-bar^(r)(x^_t, y ⊙ m) ||^2 (eq. 15; full label: the path's
    teacher, marginal / none: the teachers' mixture), L_studentCI = L_CI of the student alone (eq. 16)."""
    g = torch.Generator().manual_seed(seed)
    student.to(device).train()
    opt_ = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    k = buf["y"].shape[1]
    tot = {"student": 0.0, "student_ci": 0.0}
    for _ in range(steps):
        idx = torch.randint(len(buf["x"]), (min(batch, len(buf["x"])),), generator=g)
        x, t, y = buf["x"][idx], buf["t"][idx], buf["y"][idx]
        y_m = mask_labels(y.cpu(), *pi, generator=g).to(device)
        target = buf["v_joint"][idx].clone()
        none = (y_m < 0).all(1)
        target[none] = buf["v_uncond"][idx][none]
        for i in range(k):
            only_i = (y_m[:, i] >= 0) & ((y_m >= 0).sum(1) == 1)
            target[only_i] = buf["v_marg"][idx][only_i, i]
        l_student = (student(x, t, y_m) - target).pow(2).mean()
        l_ci = ci_penalty(student, x, t, y) if lambda_ci > 0 else torch.zeros(())
        loss = l_student + lambda_ci * l_ci
        opt_.zero_grad(set_to_none=True)
        loss.backward()
        opt_.step()
        tot["student"] += l_student.item()
        tot["student_ci"] += float(l_ci.detach())
    student.eval()
    return {k_: v / steps for k_, v in tot.items()}


class DcfmStrategy(FlowStrategy):
    phases = (P.TRAIN, P.PEER, P.RECEIVE)

    def sampler(self, y: torch.Tensor, part: int) -> Callable:
        if self.opts.variant == "b":
            return composite_field(self.student, y)
        ids = sorted(self.experts)
        return mixture_composite([self.experts[a] for a in ids], [self.counts[a] for a in ids], y)

    def peers_for(self) -> Callable[[int], dict[str, Any]]:
        """Variant A's allgather: to each node the N - 1 peer experts and their pair counts."""
        ids, recs = self.frozen()
        crec = {a: ArrayRecord({P.PAIRS: self.counts[a]}) for a in ids}
        pid_of = {n: p for p, n in self.node_of.items()}

        def records(node: int) -> dict[str, Any]:
            out = {}
            for a in ids:
                if a != pid_of[node]:
                    out[f"{P.PEER_PREFIX}{a}"] = recs[a]
                    out[f"{P.PEER_COUNTS_PREFIX}{a}"] = crec[a]
            return out
        return records

    def distill(self) -> dict[str, Any]:
        """Variant B: replay buffer from the frozen teachers, then the student (eq. 17)."""
        ids = sorted(self.experts)
        buf = replay_buffer(self.experts, self.counts, self.task.shape, paths=self.opts.replay_paths,
                            steps=self.opts.path_steps, seed=self.run.cfg.seed + 5, device=self.run.device)
        buf = teacher_targets(buf, [self.experts[a] for a in ids], [self.counts[a] for a in ids])
        student = self.task.new_model().to(self.run.device)
        stats = distill_student(student, buf, steps=self.opts.distill_steps, batch=self.run.cfg.batch_size,
                                lr=self.opts.lr, pi=self.opts.student_pi, lambda_ci=self.opts.lambda_student,
                                seed=self.run.cfg.seed + 6, device=self.run.device)
        self.student = student.eval().requires_grad_(False)
        save_model(self.run.out, self.student.state_dict())
        return {f"distill_{k}": v for k, v in stats.items()} | {"replay_states": len(buf["x"])}

    def execute(self, grid) -> dict[str, Any]:
        nodes = self.setup(grid)
        self.stage_one(grid, nodes, self.opts.lambda_ci)  # L_FM + lambda L_CI
        extra: dict[str, Any] = {"variant": self.opts.variant}
        if self.opts.variant == "a":
            for r in range(1, self.opts.rounds + 1):
                with timed(self.run, f"peer_round{r}"):  # each expert retrained with L_peerCI, peers frozen
                    records, nodes = self.peers_for(), sorted(self.node_of.values())
                    self.experts, self.counts = {}, {}
                    self.keep_experts(self.exchange(grid, P.PEER, nodes, records, self.task.validate,
                                                    config=self.run_config_record(**{ROUND_KEY: r})))
            extra["rounds"] = self.opts.rounds
        else:
            with timed(self.run, "distill"):
                extra.update(self.distill())
            student = ArrayRecord({k: v.cpu() for k, v in self.student.state_dict().items()})
            self.exchange(grid, P.RECEIVE, sorted(self.node_of.values()), lambda n: {ARRAYS_KEY: student})
        return self.finish(extra)
