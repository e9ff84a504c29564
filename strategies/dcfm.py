"""DCFM (ICML 2026, "Compositional Generative Modeling from Decentralized Data"): server side.

Protocol (clients/dcfm.py has the client side and the equations):
1. Stage I (`train`, no model down): every client trains a local expert v^(a)(x_t, t, y ⊙ m) with
   L_FM + lambda L_CI and uploads it with its pair counts n_a(y_1, y_2).
2. Variant A (`dcfm.variant = a`): R rounds (`dcfm.rounds`) of an allgather (`query.peer`): every client
   gets the N - 1 peer experts, trains its own with L_FM + lambda L_peerCI (peers frozen) and uploads it.
   Sampling: the composite velocity over all experts (clients.dcfm.mixture_composite).
   Variant B (`dcfm.variant = b`): the server distils the frozen experts into one student on synthetic
   replay paths x^_t (L_student, eq. 15) plus the student's own CI penalty (L_studentCI, eq. 16) and
   sends it back (`query.receive`): two model transfers per client. Sampling: the student's composite.
3. Evaluation on the server (shared with the baselines in strategies/fedflow.py): samples for every seen
   and every novel (digit, colour) pair, read by reference classifiers trained on real data.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp.strategy import Strategy

from fedapp.models.compose import (COUNTS_KEY, EXPERT_KEY, PEER_COUNTS_PREFIX, PEER_PREFIX, PHASE_KEY, build_velocity,
                                   ci_penalty, composite_field, generate, mask_labels, mixture_composite)
from fedapp.config import ConfigError, opt
from strategies.base import (RUN_KEY, FedappStrategy, ServerRun, check_arrays, keep_valid, make_messages, partition_of,
                             record_nbytes)

log = logging.getLogger("fedapp")
ATTRS = ("digit", "color")


@dataclass(frozen=True)
class DcfmOptions:
    variant: str = opt("b", choices=("a", "b"), help="a: peer-CI allgather rounds; b: distil one student")
    pi_full: float = opt(0.5, low=0.0, help="pi_full: probability of the full label y in the mask m (eq. 8)")
    pi_marg: float = opt(0.3, low=0.0, help="pi_marg: probability of one attribute y_i alone")
    pi_uncond: float = opt(0.2, low=0.0, help="pi_uncond: probability of no label")
    lambda_ci: float = opt(1.0, low=0.0, help="lambda: weight of L_CI / L_peerCI / L_studentCI")
    rounds: int = opt(2, low=1, help="R: peer-CI allgather rounds of variant A (paper ~2)")
    local_steps: int = opt(300, low=1, help="Stage I Adam steps per client (also DDM / local-only experts)")
    peer_steps: int = opt(100, low=1, help="variant A: Adam steps per client per round")
    distill_steps: int = opt(300, low=1, help="variant B: Adam steps of the student on the server")
    lambda_student: float = opt(5.0, low=0.0, help="variant B: lambda of L_studentCI (eq. 17)")
    student_pi_marg: float = opt(0.0, low=0.0, high=1.0,
                                 help="variant B: share of replay queries with one attribute (target: the teachers' mixture)")
    student_pi_uncond: float = opt(0.0, low=0.0, high=1.0,
                                   help="variant B: share of replay queries with no label (target: the teachers' mixture)")
    replay_paths: int = opt(256, low=1, help="variant B: synthetic replay paths (ODE trajectories of the teachers)")
    path_steps: int = opt(8, low=1, help="variant B: Euler steps of each replay path (states kept per path)")
    sample_steps: int = opt(16, low=1, help="Euler steps of every sampler")
    samples_per_pair: int = opt(12, low=2, help="evaluation: samples per (digit, colour) pair")
    lr: float = opt(2e-3, low=0.0, low_open=True, help="AdamW learning rate of experts, student, FedFlow")
    width: int = opt(32, low=8, help="velocity UNet channels (width, 2 width)")
    fl_local_steps: int = opt(20, low=1, help="fedflow: local steps per round (rounds = num-server-rounds)")
    router_steps: int = opt(200, low=1, help="ddm: Adam steps of the router (x_t, t) -> expert")
    ref_epochs: int = opt(8, low=1, help="epochs of the reference classifiers (digit, colour) on real data")

    def __post_init__(self) -> None:
        if self.pi_full + self.pi_marg + self.pi_uncond <= 0:
            raise ConfigError("dcfm.pi-full + dcfm.pi-marg + dcfm.pi-uncond: must be > 0")
        if self.student_pi_marg + self.student_pi_uncond > 1:
            raise ConfigError(f"dcfm.student-pi-marg + dcfm.student-pi-uncond = "
                              f"{self.student_pi_marg + self.student_pi_uncond}: must be <= 1")

    @property
    def pi(self) -> tuple[float, float, float]:
        return self.pi_full, self.pi_marg, self.pi_uncond

    @property
    def student_pi(self) -> tuple[float, float, float]:
        return 1.0 - self.student_pi_marg - self.student_pi_uncond, self.student_pi_marg, self.student_pi_uncond


# ---- validation ----------------------------------------------------------------------------------------
def validate_expert(content: RecordDict, expected: dict[str, tuple], sizes: list[int],
                    max_bytes: float | None) -> str | None:
    """An expert upload: the velocity net's exact keys/shapes (finite), and integer, non-negative,
    non-empty pair counts of shape (|Y_1|, |Y_2|)."""
    why = check_arrays(content.array_records.get(EXPERT_KEY), expected, max_bytes)
    if why is not None:
        return why
    why = check_arrays(content.array_records.get(COUNTS_KEY), {"pairs": tuple(sizes)})
    if why is not None:
        return f"counts: {why}"
    c = content.array_records[COUNTS_KEY]["pairs"].numpy()
    if c.dtype.kind not in "iu" or (c < 0).any() or c.sum() == 0:
        return "counts: not non-negative integers, or all zero"
    return None


def tensors(rec: ArrayRecord) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(a.numpy().copy()) for k, a in rec.items()}


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


# ---- the shared server: experts in, samples out, metrics ------------------------------------------------
class FlowStrategy(FedappStrategy, Strategy):
    """What DCFM and its baselines share: the velocity net, Stage I uploads, evaluation, comm figures."""

    name = "flow"

    def __init__(self, run: ServerRun):
        self.bind(run)
        self.opts: DcfmOptions = run.cfg.options
        self.experts: dict[int, Any] = {}
        self.counts: dict[int, torch.Tensor] = {}
        self.node_of: dict[int, int] = {}
        self.server = None
        self.sizes: list[int] = []

    # Flower's Strategy hooks are unused: execute() drives the phases itself.
    def configure_train(self, *a, **k) -> Iterable[Message]:
        return []

    def aggregate_train(self, *a, **k):
        return None, None

    def configure_evaluate(self, *a, **k) -> Iterable[Message]:
        return []

    def aggregate_evaluate(self, *a, **k):
        return None

    def summary(self) -> None:
        pass

    # ---- helpers --------------------------------------------------------------------------------------
    def setup(self, grid) -> list[int]:
        from feddata import load_server_data

        cfg = self.run.cfg
        nodes = sorted(grid.get_node_ids())
        self.server = load_server_data(cfg.dataset, cfg.partitioner, cfg.partitioner_params, cfg.seed, len(nodes),
                                       image_size=cfg.image_size)
        if "novel_pairs" not in self.server.meta:
            raise ConfigError(f"method={cfg.method!r} needs pairs of attributes: dataset=colored-digits with "
                              f"partitioner=attribute-holdout (got {cfg.dataset}, {cfg.partitioner})")
        self.sizes = [len(self.server.info.attributes[a]) for a in ATTRS]
        net = self.new_model()
        self.expected = {k: tuple(v.shape) for k, v in net.state_dict().items()}
        # one model transfer = the serialised ArrayRecord of a velocity net, as the MeteredGrid counts it
        self.model_bytes = record_nbytes(RecordDict({EXPERT_KEY: ArrayRecord(net.state_dict())}))
        return nodes

    def new_model(self):
        torch.manual_seed(self.run.cfg.seed)
        return build_velocity(self.run.cfg.image_size, self.sizes, self.opts.width, self.server.info.channels)

    def load(self, state: dict[str, torch.Tensor]):
        m = self.new_model()
        m.load_state_dict(state)
        return m.to(self.run.device).eval().requires_grad_(False)

    def send(self, grid, nodes: list[int], mtype: str, content_for: Callable[[int], RecordDict]) -> list[Message]:
        msgs = make_messages(grid, nodes, mtype, content_for)
        return list(grid.send_and_receive(msgs, timeout=self.run.cfg.round_timeout))

    def keep_experts(self, replies: list[Message], phase: str) -> list[Message]:
        cap = self.run.cfg.max_upload_mb * 2**20
        kept = keep_valid(self.run, replies, phase, lambda c: validate_expert(c, self.expected, self.sizes, cap))
        for r in kept:
            pid = partition_of(r)
            pid = pid if pid is not None else r.metadata.src_node_id
            self.node_of[pid] = r.metadata.src_node_id
            self.experts[pid] = self.load(tensors(r.content.array_records[EXPERT_KEY]))
            self.counts[pid] = tensors(r.content.array_records[COUNTS_KEY])["pairs"].long()
        return kept

    def stage_one(self, grid, nodes: list[int], lambda_ci: float) -> None:
        """Every client trains its expert from scratch and uploads it (one model transfer up)."""
        t0 = time.time()
        conf, phase = self.run_config_record(), ConfigRecord({"lambda": float(lambda_ci)})
        replies = self.send(grid, nodes, "train", lambda n: RecordDict({RUN_KEY: conf, PHASE_KEY: phase}))
        self.keep_experts(replies, "train")
        self.run.phase_seconds["stage1"] = time.time() - t0
        log.info("[stage I] experts of clients %s (lambda=%.3g)", sorted(self.experts), lambda_ci)

    def sampler(self, y: torch.Tensor, part: int) -> Callable:  # pragma: no cover - abstract
        """The velocity field (x, t) -> v for requested labels y; `part` splits work across experts."""
        raise NotImplementedError

    # ---- evaluation -----------------------------------------------------------------------------------
    def reference_classifiers(self) -> dict[str, torch.nn.Module]:
        """SmallCNNs for digit and for colour trained on the server's real public + test images.
        (Not Inception: Frechet distances below are on these classifiers' features.)"""
        from fedapp.models.classifier import SmallCNN, train_classifier

        s = self.server
        x = torch.cat([s.public.x, s.test.x]).float()
        out = {}
        for i, a in enumerate(ATTRS):
            y = torch.cat([torch.as_tensor(s.public.attrs[a]), torch.as_tensor(s.test.attrs[a])]).long()
            torch.manual_seed(self.run.cfg.seed + i)
            out[a] = train_classifier(SmallCNN(self.sizes[i], in_ch=s.info.channels), x, y,
                                      epochs=self.opts.ref_epochs, seed=self.run.cfg.seed + i)
        return out

    @torch.no_grad()
    def generate_pairs(self, pairs: list[list[int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.opts.samples_per_pair
        y = torch.tensor(pairs, dtype=torch.long).repeat_interleave(n, 0)
        shape = (self.server.info.channels, self.run.cfg.image_size, self.run.cfg.image_size)
        x, parts = torch.zeros(len(y), *shape), self.parts()
        for p in range(parts):  # local-only: each expert answers every parts-th request
            yp = y[p::parts]
            if len(yp):
                field = self.sampler(yp.to(self.run.device), p)
                x[p::parts] = generate(field, (len(yp), *shape), self.opts.sample_steps, seed + p, self.run.device).cpu()
        return x, y

    def parts(self) -> int:
        return 1

    def evaluate(self) -> dict[str, Any]:
        from fedapp.metrics import composition_accuracy, frechet_distance
        from fedapp.models.classifier import embed_all, predict

        t0 = time.time()
        ref = self.reference_classifiers()
        test = self.server.test
        ty = torch.stack([torch.as_tensor(test.attrs[a]).long() for a in ATTRS], 1)
        out: dict[str, Any] = {}
        samples = {}
        for kind in ("seen", "novel"):
            pairs = self.server.meta[f"{kind}_pairs"]
            x, y = self.generate_pairs(pairs, self.run.cfg.seed + (0 if kind == "seen" else 1000))
            samples[kind] = (x, y)
            pred = [predict(ref[a], x) for a in ATTRS]
            out[f"{kind}_composition_accuracy"] = composition_accuracy(pred[0], pred[1], y[:, 0], y[:, 1])
            out[f"{kind}_digit_accuracy"] = float((pred[0] == y[:, 0]).float().mean())
            out[f"{kind}_color_accuracy"] = float((pred[1] == y[:, 1]).float().mean())
            pair_set = {tuple(p) for p in pairs}
            real = torch.tensor([tuple(r) in pair_set for r in ty.tolist()])
            # Frechet distance on the concatenated digit + colour reference features (not Inception)
            fr = torch.cat([embed_all(ref[a], test.x[real].float()) for a in ATTRS], 1).numpy()
            fg = torch.cat([embed_all(ref[a], x) for a in ATTRS], 1).numpy()
            out[f"{kind}_distance"] = frechet_distance(fg, fr)
        self.save_grid(samples)
        self.run.phase_seconds["evaluation"] = time.time() - t0
        return out

    def save_grid(self, samples: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """digit x colour grid, one sample per cell; novel cells framed in white."""
        save_pair_grid(samples, self.sizes, self.server.meta["novel_pairs"], self.run.out.path("images", "grid.png"))

    def comm_metrics(self) -> dict[str, Any]:
        """Model transfers per client, counted from the metered messages: (bytes up + down) / model bytes."""
        cfg_bytes = record_nbytes(RecordDict({RUN_KEY: self.run_config_record()}))  # rides on every message down
        per = self.run.comm()["per_client"]
        transfers = {c: (r["up_bytes"] + r["down_bytes"] - r["messages_down"] * cfg_bytes) / self.model_bytes
                     for c, r in per.items()}
        vals = list(transfers.values()) or [0.0]
        return {"model_bytes": self.model_bytes,
                "model_transfers_per_client": round(sum(vals) / len(vals), 3),
                "model_transfers_by_client": {c: round(v, 3) for c, v in sorted(transfers.items())}}

    def finish(self, extra: dict[str, Any]) -> dict[str, Any]:
        metrics = {**self.evaluate(), **extra}
        metrics.update(self.comm_metrics())
        metrics["num_experts"] = len(self.experts)
        self.run.out.log_metrics({"phase": "final", **metrics})
        log.info("[%s] seen acc %.3f novel acc %.3f seen FD %.2f novel FD %.2f, %.2f transfers/client",
                 self.run.cfg.method, metrics["seen_composition_accuracy"], metrics["novel_composition_accuracy"],
                 metrics["seen_distance"], metrics["novel_distance"], metrics["model_transfers_per_client"])
        return metrics


def save_pair_grid(samples: dict, sizes: list[int], novel: list[list[int]], path) -> None:
    import numpy as np
    from PIL import Image

    d, c = sizes
    x_all = torch.cat([samples[k][0] for k in samples])
    y_all = torch.cat([samples[k][1] for k in samples])
    h = x_all.shape[-1]
    pad = 2
    cell = h + 2 * pad
    img = np.zeros((d * cell, c * cell, 3), dtype=np.uint8)
    novel_set = {tuple(p) for p in novel}
    for a in range(d):
        for b in range(c):
            hit = ((y_all[:, 0] == a) & (y_all[:, 1] == b)).nonzero()
            if len(hit) == 0:
                continue
            if (a, b) in novel_set:
                img[a * cell:(a + 1) * cell, b * cell:(b + 1) * cell] = 255  # frame: a novel pair
            im = ((x_all[int(hit[0])].clamp(-1, 1) + 1) * 127.5).byte().permute(1, 2, 0).numpy()
            img[a * cell + pad:a * cell + pad + h, b * cell + pad:b * cell + pad + h] = im
    scale = max(1, 128 // cell)
    Image.fromarray(img).resize((img.shape[1] * scale, img.shape[0] * scale), Image.NEAREST).save(path)


class DcfmStrategy(FlowStrategy):
    name = "dcfm"

    def sampler(self, y: torch.Tensor, part: int) -> Callable:
        if self.opts.variant == "b":
            return composite_field(self.student, y)
        ids = sorted(self.experts)
        return mixture_composite([self.experts[a] for a in ids], [self.counts[a] for a in ids], y)

    def peer_round(self, grid, rnd: int) -> None:
        """Variant A, one allgather: each client receives the N - 1 peers (and their counts) and returns
        its expert trained with L_peerCI against them."""
        ids = sorted(self.experts)
        recs = {a: ArrayRecord(self.experts[a].state_dict()) for a in ids}
        crec = {a: ArrayRecord({"pairs": self.counts[a]}) for a in ids}
        conf = self.run_config_record(**{"server-round": rnd})
        pid_of = {n: p for p, n in self.node_of.items()}

        def content(node: int) -> RecordDict:
            me = pid_of[node]
            rd = RecordDict({RUN_KEY: conf})
            for a in ids:
                if a != me:
                    rd[f"{PEER_PREFIX}{a}"] = recs[a]
                    rd[f"{PEER_COUNTS_PREFIX}{a}"] = crec[a]
            return rd

        t0 = time.time()
        nodes = sorted(pid_of)
        self.experts, self.counts = {}, {}
        self.keep_experts(self.send(grid, nodes, "query.peer", content), "query.peer")
        self.run.phase_seconds[f"peer_round{rnd}"] = time.time() - t0

    def distill(self, grid) -> dict[str, float]:
        """Variant B: replay buffer from the frozen teachers, student distillation, student sent back."""
        t0 = time.time()
        ids = sorted(self.experts)
        shape = (self.server.info.channels, self.run.cfg.image_size, self.run.cfg.image_size)
        buf = replay_buffer(self.experts, self.counts, shape, paths=self.opts.replay_paths,
                            steps=self.opts.path_steps, seed=self.run.cfg.seed + 5, device=self.run.device)
        buf = teacher_targets(buf, [self.experts[a] for a in ids], [self.counts[a] for a in ids])
        student = self.new_model().to(self.run.device)
        stats = distill_student(student, buf, steps=self.opts.distill_steps, batch=self.run.cfg.batch_size,
                                lr=self.opts.lr, pi=self.opts.student_pi, lambda_ci=self.opts.lambda_student,
                                seed=self.run.cfg.seed + 6, device=self.run.device)
        self.student = student.eval().requires_grad_(False)
        self.run.phase_seconds["distill"] = time.time() - t0
        rec = ArrayRecord({k: v.cpu() for k, v in student.state_dict().items()})
        conf = self.run_config_record()
        self.send(grid, sorted(self.node_of.values()), "query.receive",
                  lambda n: RecordDict({RUN_KEY: conf, "arrays": rec}))
        return {f"distill_{k}": v for k, v in stats.items()} | {"replay_states": len(buf["x"])}

    def execute(self, grid) -> dict[str, Any]:
        nodes = self.setup(grid)
        self.stage_one(grid, nodes, self.opts.lambda_ci)
        extra: dict[str, Any] = {"variant": self.opts.variant}
        if self.opts.variant == "a":
            for r in range(1, self.opts.rounds + 1):
                self.peer_round(grid, r)
            extra["rounds"] = self.opts.rounds
        else:
            extra.update(self.distill(grid))
        return self.finish(extra)
