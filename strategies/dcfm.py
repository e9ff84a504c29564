"""DCFM (ICML 2026, "Compositional Generative Modeling from Decentralized Data"): server side.

Protocol (clients/dcfm.py has the client side and the equations):
1. Stage I (`train`, no model down): every client trains a local expert v^(a)(x_t, t, y ⊙ m) with
   L_FM + lambda L_CI and uploads it with its pair counts n_a(y_1, y_2).
2. Variant A (`dcfm.variant = a`): R rounds (`dcfm.rounds`) of an allgather (`query.peer`): every client
   gets the N - 1 peer experts, trains its own with L_FM + lambda L_peerCI (peers frozen) and uploads it;
   `dcfm.peer-schedule = sequential` runs the clients of a round one after another instead.
   Sampling: the composite velocity over all experts (fedapp.models.compose.mixture_composite), with the
   routing vector in expectation or drawn once a sample (`dcfm.a-sampler`). After Stage I and after each
   round the server records the composites' residuals and the experts' gauge figures (`ci_by_round`).
   Variant B (`dcfm.variant = b`): the server distils the frozen experts into one student on synthetic
   replay paths x^_t (`dcfm.replay`: each teacher's own, or their routed composite; L_student on y ⊙ m,
   eq. 15) plus the student's own CI
   penalty (L_studentCI, eq. 16), with the same lambda and masks as Stage I, and
   sends it back (`query.receive`): two model transfers per client. Sampling: the student's composite.
3. Evaluation on the server (strategies/flow.py, shared with the baselines): samples for every seen
   and every novel (digit, colour) pair, read by reference classifiers trained on real data.
Record keys, phases and upload validation: fedapp/protocols/dcfm.py.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from flwr.app import ArrayRecord

from fedapp.models.compose import (NULL, attribute_labels, ci_penalty, ci_residuals, ci_sample, composite_field,
                                   mask_labels, mixture_composite, of_pairs)
from fedapp.models.flow import sample_path
from fedapp.progress import track
from fedapp.protocols import ARRAYS_KEY, ROUND_KEY
from fedapp.protocols import dcfm as P
from fedapp.server.checkpoint import save_model
from fedapp.server.validation import check_reply, safe_reason
from strategies.flow import FlowStrategy

log = logging.getLogger("fedapp")


# ---- variant A: the peer rounds' schedule -----------------------------------------------------------------
def peer_round_groups(ids: list[int], schedule: str) -> list[list[int]]:
    """One variant-A round (dcfm.peer-schedule) as the groups of experts that retrain together, in order;
    each group retrains against the experts as they stand when it starts. allgather: one group of all of
    them, against the round's start (the paper); sequential: one expert at a time, against the peers as
    already retrained this round. The strategy's peer_round and the 2-D toy (experiments/dcfm_toy.py)."""
    if schedule == "allgather":
        return [list(ids)]
    if schedule == "sequential":
        return [[a] for a in ids]
    raise ValueError(f"peer schedule {schedule!r}: allowed 'allgather', 'sequential'")


@torch.no_grad()
def uncond_fields(experts: dict[int, Any], x1: torch.Tensor, seed: int) -> dict[int, torch.Tensor]:
    """Each expert's unconditional field v^(a)(x_t, t, ∅) at one set of points x_t = t x1 + (1 - t) x0, x0 and
    t drawn from `seed` as ci_residuals draws them (so at its points): where a route whose r_0 is a peer
    (eq. 12) puts one expert's unconditional term in another's composite."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(x1.shape, generator=g).to(x1.device)
    t = torch.rand(len(x1), generator=g).to(x1.device)
    x_t, null = sample_path(x0, x1, t), torch.full((len(x1), len(P.ATTRS)), NULL, device=x1.device)
    return {a: e(x_t, t, null) for a, e in experts.items()}


def gauge_figures(now: dict[int, torch.Tensor], before: dict[int, torch.Tensor] | None) -> dict[str, float]:
    """The 2-D toy's gauge diagnosis (experiments/dcfm_toy.py uncond_gap) on the experts' unconditional fields
    (uncond_fields), each figure relative to the fields' mean squared size mean_a ||v_a||^2:
    uncond_gap: mean_a ||v_a - mean_b v_b||^2, how far apart the experts' fields are (0: one gauge);
    with the fields at the round's start (`before`; experts present in both):
    uncond_moved: mean_a ||v_a - v_a(before)||^2, how far each expert's field moved in the round;
    uncond_to_peers: mean_a ||v_a - mean_{b != a} v_b(before)||^2, how far it now sits from where its peers
    stood. An allgather that swaps gauges instead of aligning them (the toy's failure) shows as a gap that
    stays while uncond_to_peers falls below uncond_moved."""
    sq = lambda d: d.pow(2).flatten(1).sum(1).mean()  # noqa: E731
    v = torch.stack([now[a] for a in sorted(now)])
    size = max(float(sum(sq(x) for x in v)) / len(v), 1e-12)
    out = {"uncond_gap": float(sum(sq(x - v.mean(0)) for x in v)) / len(v) / size}
    ids = [a for a in sorted(now) if before is not None and a in before]
    if len(ids) >= 2:
        total = sum(before[a] for a in ids)
        out["uncond_moved"] = float(sum(sq(now[a] - before[a]) for a in ids)) / len(ids) / size
        out["uncond_to_peers"] = float(sum(sq(now[a] - (total - before[a]) / (len(ids) - 1))
                                           for a in ids)) / len(ids) / size
    return out


# ---- variant B: distillation into one student (eqs. 15-17) ---------------------------------------------
def seen_pairs(counts: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """n labels y drawn from the pairs of a count table n(y_1, y_2), ∝ the counts."""
    cell = torch.multinomial(counts.double().flatten() / counts.sum(), n, replacement=True, generator=generator)
    return torch.stack([cell // counts.shape[1], cell % counts.shape[1]], 1)


def replay_fields(experts: dict[int, Any], counts: dict[int, torch.Tensor], paths: int, mode: str,
                  route_mask: bool, g: torch.Generator) -> list[tuple[torch.Tensor, Callable]]:
    """(labels, field) per group of replay paths (dcfm.replay):
    teacher: a frozen teacher r ∝ n_r per path, y from its own pairs, its joint field v^(r)(x, y) (eq. 15
      as the paper notes read it: "a teacher's velocity is the truth on its own probability path");
    composite: y from all seen pairs, the routed composite over the experts (routes in expectation, the
      field variant A samples with)."""
    ids = sorted(experts)
    if mode == "composite":
        y = seen_pairs(sum(counts[a] for a in ids), paths, g)
        return [(y, mixture_composite([experts[a] for a in ids], [counts[a] for a in ids], y, route_mask))]
    n = torch.stack([counts[a].sum() for a in ids]).double()
    who = torch.multinomial(n / n.sum(), paths, replacement=True, generator=g)
    groups = []
    for j, a in enumerate(ids):
        if (who == j).any():
            y = seen_pairs(counts[a], int((who == j).sum()), g)
            groups.append((y, lambda x, t, y=y, e=experts[a]: e(x, t, y.to(x.device))))
    return groups


@torch.no_grad()
def replay_buffer(experts: dict[int, Any], counts: dict[int, torch.Tensor], shape: tuple[int, ...], *,
                  paths: int, steps: int, seed: int, mode: str = "teacher", route_mask: bool = True,
                  device: str = "cpu") -> dict[str, torch.Tensor]:
    """Synthetic replay paths x^_t (eq. 15): Euler trajectories of the frozen teacher field v-bar^(r)(x, y)
    (`mode`: replay_fields) from x0 ~ N(0, I). Keeps every state with its t, y and the field's velocity
    there (L_student's target)."""
    g = torch.Generator().manual_seed(seed)
    xs, ts, ys, vs = [], [], [], []
    for y, field in replay_fields(experts, counts, paths, mode, route_mask, g):
        x, y = torch.randn((len(y), *shape), generator=g).to(device), y.to(device)
        for s in range(steps):
            t = torch.full((len(x),), s / steps, device=device)
            v = field(x, t)
            xs.append(x), ts.append(t), ys.append(y), vs.append(v)  # type: ignore[func-returns-value]
            x = x + v / steps
    return {"x": torch.cat(xs), "t": torch.cat(ts), "y": torch.cat(ys), "v": torch.cat(vs)}


def distill_student(student, buf: dict[str, torch.Tensor], *, steps: int, batch: int, lr: float,
                    pi: tuple[float, float, float], lambda_ci: float, seed: int, device: str = "cpu",
                    ci_batch: int = 0) -> dict:
    """L_DCFM-B = L_student + lambda L_studentCI (eq. 17):
    L_student = E || v_s(x^_t, t, y ⊙ m) - v-bar^(r)(x^_t, y) ||^2 (eq. 15, m ~ p(m) of eq. 8: the student
    sees masked labels, the target is the teacher's velocity of the path's full label, as u_t is in L_FM),
    L_studentCI = L_CI of the student alone on the full labels (eq. 16)."""
    g = torch.Generator().manual_seed(seed)
    student.to(device).train()
    opt_ = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    tot = {"student": 0.0, "student_ci": 0.0}
    for _ in track(range(steps), "distillation steps", eta=True):
        idx = torch.randint(len(buf["x"]), (min(batch, len(buf["x"])),), generator=g)
        x, t, y = buf["x"][idx], buf["t"][idx], buf["y"][idx]
        y_m = mask_labels(y.cpu(), *pi, generator=g).to(device)
        l_student = (student(x, t, y_m) - buf["v"][idx]).pow(2).mean()
        l_ci = ci_penalty(student, *ci_sample(ci_batch, x, t, y)) if lambda_ci > 0 else torch.zeros(())
        loss = l_student + lambda_ci * l_ci
        opt_.zero_grad(set_to_none=True)
        loss.backward()
        opt_.step()
        tot["student"] += l_student.item()
        tot["student_ci"] += float(l_ci.detach())
    student.eval()
    return {k_: v / steps for k_, v in tot.items()}


class DcfmStrategy(FlowStrategy):
    def sampler(self, y: torch.Tensor, part: int) -> Callable:
        if self.opts.variant == "b":
            return composite_field(self.student, y)
        ids = sorted(self.experts)
        routes = None
        if self.opts.a_sampler == "routed":  # one generator a run: the evaluation's calls draw in turn
            if getattr(self, "_routes", None) is None:
                self._routes = torch.Generator().manual_seed(self.run.cfg.seed + 7)
            routes = self._routes
        return mixture_composite([self.experts[a] for a in ids], [self.counts[a] for a in ids], y,
                                 self.opts.route_mask, routes)

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

    def peer_round(self, grid, r: int) -> None:
        """One variant-A round (dcfm.peer-schedule). allgather: every client against the experts of the
        round's start, at once (the paper). sequential: client by client, each against the peers as
        already retrained this round (same transfers; a client that fails keeps its previous expert)."""
        config = self.run_config_record(**{ROUND_KEY: r})
        groups = peer_round_groups(sorted(self.node_of.values()), self.opts.peer_schedule)
        if self.opts.peer_schedule == "allgather":
            [nodes] = groups
            records = self.peers_for()
            self.experts, self.counts = {}, {}
            self.keep_experts(self.exchange(grid, P.PEER, nodes, records, self.task.validate, config=config))
            return
        kept = 0
        for group in groups:  # one node each: a client that fails keeps its previous expert
            replies = self.exchange(grid, P.PEER, group, self.peers_for(), config=config)
            valid = [r for r in replies if self.valid_peer_reply(r)]
            self.keep_experts(valid)
            kept += len(valid)
        if kept < self.run.cfg.min_clients:
            raise RuntimeError(f"[{P.PEER.name}] only {kept} valid replies in round {r}, fewer than "
                               f"min-clients={self.run.cfg.min_clients}; see failures")

    def valid_peer_reply(self, reply) -> bool:
        """The upload gate for one reply of a sequential round (min-clients is checked over the round);
        a rejection is recorded with its node and reason, as keep_valid does."""
        if reply.has_error():
            return False  # already recorded by MeteredGrid
        reason = safe_reason(lambda: check_reply(self.run, reply, P.PEER, self.task.validate))
        if reason is not None:
            self.run.fail(reply.metadata.src_node_id, P.PEER.name, f"invalid upload: {reason}")
        return reason is None

    def distill(self) -> dict[str, Any]:
        """Variant B: replay buffer from the frozen teachers, then the student (eq. 17)."""
        buf = replay_buffer(self.experts, self.counts, self.task.shape, paths=self.opts.replay_paths,
                            steps=self.opts.path_steps, seed=self.run.cfg.seed + 5, mode=self.opts.replay,
                            route_mask=self.opts.route_mask,
                            device=self.run.device)
        student = self.task.new_model().to(self.run.device)
        stats = distill_student(student, buf, steps=self.opts.distill_steps, batch=self.run.cfg.batch_size,
                                lr=self.opts.lr, pi=self.opts.pi, lambda_ci=self.opts.lambda_ci,
                                ci_batch=self.opts.ci_batch,
                                seed=self.run.cfg.seed + 6, device=self.run.device)
        self.student = student.eval().requires_grad_(False)
        save_model(self.run.out, self.student.state_dict())
        return {f"distill_{k}": v for k, v in stats.items()} | {"replay_states": len(buf["x"])}

    def diagnostic_images(self, limit: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        """(x1, y): at most `limit` real test images of the seen pairs and their labels."""
        test = self.task.server.test
        ty = attribute_labels(test, P.ATTRS)
        idx = of_pairs(ty, self.task.server.meta["seen_pairs"]).nonzero()[:limit, 0]
        return test.x[idx].float().to(self.run.device), ty[idx].to(self.run.device)

    def ci_diagnostics(self) -> dict[str, float]:
        """ci_residuals on diagnostic_images: variant A's experts (their own composites and the mixture A samples
        with), variant B's student alone (its composite against its joint field; the mixture entry then equals
        it)."""
        x1, y = self.diagnostic_images()
        if self.opts.variant == "b":
            nets, counts = [self.student], [sum(self.counts.values())]
        else:
            ids = sorted(self.experts)
            nets, counts = [self.experts[a] for a in ids], [self.counts[a] for a in ids]
        return ci_residuals(nets, counts, x1, y, seed=self.run.cfg.seed + 11, route_mask=self.opts.route_mask)

    def round_record(self, r: int, before: dict[int, torch.Tensor] | None
                     ) -> tuple[dict[str, float], dict[int, torch.Tensor]]:
        """Variant A after peer round r (0: Stage I): the composites' residuals (ci_diagnostics) and the gauge
        figures against the round's start (gauge_figures), at the same points; and the unconditional fields,
        the next round's `before`. What a figure of the rounds reads to tell why A fails, not only that."""
        fields = uncond_fields(self.experts, self.diagnostic_images()[0], seed=self.run.cfg.seed + 11)
        rec = {"round": r, **self.ci_diagnostics(), **gauge_figures(fields, before)}
        log.info("dcfm-a (%s) after round %d: %s", self.opts.peer_schedule, r,
                 ", ".join(f"{k} {v:.4f}" for k, v in rec.items() if k != "round"))
        return rec, fields

    def execute(self, grid) -> dict[str, Any]:
        nodes = self.setup(grid)
        self.stage_one(grid, nodes, self.opts.lambda_ci)  # L_FM + lambda L_CI
        extra: dict[str, Any] = {"variant": self.opts.variant}
        if self.opts.variant == "a":
            trace, fields = [], None
            for r in range(self.opts.rounds + 1):
                if r:
                    with self.run.phase(f"peer_round{r}"):  # each expert retrained with L_peerCI, peers frozen
                        self.peer_round(grid, r)
                rec, fields = self.round_record(r, fields)
                trace.append(rec)
            extra.update(rounds=self.opts.rounds, peer_schedule=self.opts.peer_schedule, ci_by_round=trace,
                         ci_residual_self=trace[-1]["ci_residual_self"],
                         ci_residual_mixture=trace[-1]["ci_residual_mixture"])
        else:
            with self.run.phase("distill"):
                extra.update(self.distill())
            student = ArrayRecord({k: v.cpu() for k, v in self.student.state_dict().items()})
            self.exchange(grid, P.RECEIVE, sorted(self.node_of.values()), lambda n: {ARRAYS_KEY: student})
            extra.update(self.ci_diagnostics())
        return self.finish(extra)
