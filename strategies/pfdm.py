"""PFDM (CVPR 2026, "Personalized Federated Training of Diffusion Models with Privacy Guarantees"):
one round; the server trains a shared denoiser z_w only on the clients' local-DP uploads.

1. `train`: each client trains its private denoiser z_theta_m (kept on the client) and uploads
   D~_m = {(sqrt(abar_t0) CLIP(x, C) + sqrt(1 - abar_t0) z, y)} (clients/pfdm.py, fedapp/privacy.py).
   The server checks keys, shapes, dtypes, finiteness and |x| == |y| and drops a bad upload.
2. The server trains z_w on the union of the D~_m for the levels (t0, T] only: Gaussian noise -> the
   mixture of the clients' noised images (DDPM.loss with source_t = t0: the uploads are already x_t0).
3. `query.sample`: z_w goes to every client, which samples shared T -> t0 then private t0 -> 0 and
   returns the samples for scoring (an evaluation step, not part of the protocol).
Evaluation (GenerationEval): Frechet distance on reference-classifier features per client for its
majority/minority classes, and three attacks on what the server holds: loss-threshold membership
inference on z_w, a nearest-neighbour memorisation check of z_w's own generations, and a
reconstruction attempt from the uploads with a denoiser the server trains on its public data.
summary.json `privacy`: epsilon (Theorem 5.1), delta, t0, clip.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from fedapp.config import opt
from fedapp.models.ddpm import DDPM, build_ddpm, train_ddpm
from fedapp.privacy import clip_norm, privacy_record, privatize, resolve_t0
from strategies.base import FedappStrategy, check_arrays, keep_valid, make_messages, partition_of

log = logging.getLogger("fedapp")

MIA_T_RANGE = (0, 300)  # attacker's levels for a model trained on clean data: small t reveal the most
MIA_DRAWS = 8           # (t, noise) draws per sample, averaged into one loss score
MEMO_RATIO = 1 / 3      # memorised: nearest training image < 1/3 of the distance to the second nearest


@dataclass(frozen=True)
class PFDMOptions:
    """Options of pfdm and its generation baselines (local-only, fedavg-ddpm, centralized-ddpm)."""

    t0: int = opt(0, low=0, high=1000, help="forward-diffusion level of the upload; 0: smallest t0 meeting pfdm.epsilon")
    epsilon: float = opt(10.0, low=0.0, low_open=True, help="target LDP epsilon (used when pfdm.t0 = 0)")
    clip: float = opt(10.0, low=0.0, low_open=True, help="C: per-sample L2 clipping norm of the upload")
    delta: float = opt(1e-5, low=0.0, low_open=True, high=0.5, help="LDP delta")
    local_steps: int = opt(300, low=1, help="steps of each client's denoiser (private / local-only; fedavg-ddpm: in total over rounds)")
    shared_steps: int = opt(300, low=1, help="steps of the server's shared denoiser (centralized-ddpm: its model)")
    batch: int = opt(64, low=1)
    lr: float = opt(2e-3, low=0.0, low_open=True, help="Adam learning rate of every denoiser")
    channels: str = opt("16,32", help="UNet2DModel block widths, comma separated")
    samples: int = opt(200, low=10, help="generated samples per client (balanced over classes) for the distances")
    sample_steps: int = opt(50, low=2, help="DDIM steps T -> 0 (split at t0 in proportion for pfdm)")
    attack_samples: int = opt(200, low=10, help="members and non-members per attack")
    ref_epochs: int = opt(8, low=1, help="epochs of the reference classifier (SmallCNN on the server's public data)")


# ---- evaluation shared with the baselines -------------------------------------------------------------
def load_partitions(cfg, num_partitions: int) -> list:
    """EVALUATION ORACLE: every client's shard, re-derived on the server (a shard is a pure function of the
    config and partition id). Used only to score attacks against the truth, never to train."""
    from feddata import load_client_shard

    return [load_client_shard(cfg.dataset, cfg.partitioner, cfg.partitioner_params, cfg.seed, pid,
                              num_partitions, image_size=cfg.image_size) for pid in range(num_partitions)]


@torch.no_grad()
def loss_scores(model: DDPM, x: torch.Tensor, y: torch.Tensor, t_range: tuple[int, int], seed: int,
                source_t: int | None = None, draws: int = MIA_DRAWS, batch: int = 256) -> np.ndarray:
    """Loss-threshold MIA score: minus the per-sample epsilon loss averaged over `draws` (t, z) draws."""
    g = torch.Generator().manual_seed(seed)
    model.eval()
    total = torch.zeros(len(x))
    for _ in range(draws):
        for i in range(0, len(x), batch):
            total[i:i + batch] += model.loss(x[i:i + batch], y[i:i + batch], t_range=t_range, source_t=source_t,
                                             generator=g, reduction="none").cpu()
    return (-total / draws).numpy()


def unit(x: torch.Tensor) -> torch.Tensor:
    """Images as unit vectors: distances that ignore the clipping scale."""
    f = x.flatten(1).double()
    return f / f.norm(dim=1, keepdim=True).clamp_min(1e-12)


def memorisation(generated: torch.Tensor, train: torch.Tensor) -> dict[str, float]:
    """Nearest-neighbour check: share of generations whose nearest training image is closer than
    MEMO_RATIO x the second nearest (unit-normalised L2), and the mean nearest distance."""
    d = torch.cdist(unit(generated), unit(train))
    two = d.topk(2, dim=1, largest=False).values
    return {"memorised_fraction": float((two[:, 0] < MEMO_RATIO * two[:, 1]).double().mean()),
            "nn_distance": float(two[:, 0].mean())}


class GenerationEval:
    """Scores generated samples for one run: a reference classifier (SmallCNN on the server's real public
    split) embeds real test images and samples; Frechet distance per class group (NOT Inception FID)."""

    def __init__(self, run, num_partitions: int):
        from feddata import load_server_data

        from fedapp.models.classifier import SmallCNN, accuracy, train_classifier

        cfg, o = run.cfg, run.cfg.options
        self.run = run
        self.server = load_server_data(cfg.dataset, cfg.partitioner, cfg.partitioner_params, cfg.seed,
                                       num_partitions, image_size=cfg.image_size)
        self.num_classes = self.server.info.num_classes
        meta = self.server.meta
        self.groups = {"majority": meta.get("majority_classes", list(range(self.num_classes))),
                       "minority": meta.get("minority_classes", [])}
        torch.manual_seed(cfg.seed)
        self.ref = train_classifier(SmallCNN(self.num_classes, width=16), self.server.public.x, self.server.public.y,
                                    epochs=o.ref_epochs, seed=cfg.seed)
        self.ref_accuracy = accuracy(self.ref, self.server.test.x, self.server.test.y)

    @torch.no_grad()
    def features(self, x: torch.Tensor) -> np.ndarray:
        return torch.cat([self.ref.embed(x[i:i + 512]) for i in range(0, len(x), 512)]).numpy()

    def distances(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """majority/minority Frechet distance to the real test images of those classes; mean = their average
        (as the paper's tables); sample_accuracy = share the reference classifier labels as requested."""
        from fedapp.metrics import frechet_distance
        from fedapp.models.classifier import accuracy

        out = {}
        for name, classes in self.groups.items():
            if not classes:
                continue
            real = self.server.test.x[torch.isin(self.server.test.y, torch.tensor(classes))]
            gen = x[torch.isin(y, torch.tensor(classes))]
            out[f"{name}_distance"] = frechet_distance(self.features(gen), self.features(real))
        present = [out[k] for k in ("majority_distance", "minority_distance") if k in out]
        out["mean_distance"] = float(np.mean(present))
        out["sample_accuracy"] = accuracy(self.ref, x, y)
        return out

    def save_grid(self, x: torch.Tensor, y: torch.Tensor, name: str, per_class: int = 8) -> str:
        """PNG under images/: one row per class."""
        from fedapp.models.tiny_prior import sample_grid

        rows = [x[y == c][:per_class] for c in range(self.num_classes)]
        if any(len(r) < per_class for r in rows):
            per_class = min(len(r) for r in rows)
        grid = torch.cat([r[:per_class] for r in rows])
        path = self.run.out.path("images", name)
        sample_grid(grid, self.num_classes, path)
        return str(path)

    def per_client(self, samples: dict[int, tuple[torch.Tensor, torch.Tensor]], prefix: str = "") -> dict[str, Any]:
        """Distances per client; the headline figures are client 0's (the paper reports the first client)."""
        per = {str(pid): self.distances(x, y) for pid, (x, y) in sorted(samples.items())}
        head = per.get("0", next(iter(per.values())))
        out = {f"{prefix}{k}": v for k, v in head.items()}
        out[f"{prefix}per_client"] = per
        return out

    def mia_clean(self, model: DDPM, member_x: torch.Tensor, member_y: torch.Tensor) -> dict[str, float]:
        """Loss-threshold MIA on a model trained on clean data: members = client 0's training images,
        non-members = the server's held-out test images; levels MIA_T_RANGE."""
        from fedapp.metrics import mia_figures

        n = min(self.run.cfg.options.attack_samples, len(member_x), len(self.server.test))
        g = torch.Generator().manual_seed(self.run.cfg.seed)
        mi = torch.randperm(len(member_x), generator=g)[:n]
        ni = torch.randperm(len(self.server.test), generator=g)[:n]
        seed = self.run.cfg.seed
        return mia_figures(loss_scores(model, member_x[mi], member_y[mi], MIA_T_RANGE, seed),
                           loss_scores(model, self.server.test.x[ni], self.server.test.y[ni], MIA_T_RANGE, seed + 1))


def sample_model(model: DDPM, n: int, num_classes: int, steps: int, seed: int):
    """Class-balanced samples of a (non-private) model over T -> 0."""
    y = torch.arange(n) % num_classes
    return model.sample(n, y, steps=steps, generator=torch.Generator().manual_seed(seed)), y


def arrays_of(reply, key: str) -> dict[str, torch.Tensor]:
    return reply.content.array_records[key].to_torch_state_dict()


# ---- the strategy ---------------------------------------------------------------------------------------
class PFDMStrategy(FedappStrategy):
    def __init__(self, run):
        self.bind(run)
        o = run.cfg.options
        self.t0 = resolve_t0(o.t0, o.epsilon, o.clip, o.delta)
        self.privacy = privacy_record(self.t0, o.clip, o.delta)

    def validate_upload(self, content: RecordDict, shape: tuple) -> str | None:
        rec = content.array_records.get("upload")
        reason = check_arrays(rec, {"x": (None, *shape), "y": (None,)}, self.run.cfg.max_upload_mb * 2**20)
        if reason is None:
            x, y = rec["x"].numpy(), rec["y"].numpy()
            if len(x) != len(y) or len(x) == 0:
                reason = f"{len(x)} images but {len(y)} labels"
            elif x.dtype.kind != "f" or y.dtype.kind not in "iu":
                reason = "x must be float and y integer"
            elif y.min() < 0 or y.max() >= self.num_classes:
                reason = f"labels outside [0, {self.num_classes})"
        return reason

    def train_shared(self, x: torch.Tensor, y: torch.Tensor) -> DDPM:
        """z_w on the uploads only, levels (t0, T]: the uploads are x_t0 (DDPM.loss source_t)."""
        cfg, o = self.run.cfg, self.run.cfg.options
        torch.manual_seed(cfg.seed)
        shared = build_ddpm(cfg.image_size, self.num_classes, flag=False, channels=o.channels)
        loss = train_ddpm(shared, x, y, steps=o.shared_steps, batch=o.batch, lr=o.lr, seed=cfg.seed,
                          t_range=(self.t0, shared.T), source_t=self.t0, device=self.run.device)
        self.run.out.log_metrics({"phase": "shared", "loss": loss, "num_uploads": len(x)})
        return shared.cpu()

    def execute(self, grid) -> dict[str, Any]:
        cfg, o, run = self.run.cfg, self.run.cfg.options, self.run
        nodes = sorted(grid.get_node_ids())
        log.info("pfdm: t0=%d C=%g -> (epsilon=%.4f, delta=%g)-LDP per data point", self.t0, o.clip,
                 self.privacy["epsilon"], o.delta)
        t = time.time()
        ev = GenerationEval(run, len(nodes))
        self.num_classes = ev.num_classes
        run.phase_seconds["reference-classifier"] = time.time() - t
        shape = (ev.server.info.channels, cfg.image_size, cfg.image_size)

        # 1. private training + local-DP uploads
        msgs = make_messages(grid, nodes, "train", lambda n: RecordDict({"config": self.run_config_record()}))
        replies = keep_valid(run, grid.send_and_receive(msgs, timeout=cfg.round_timeout), "train",
                             lambda c: self.validate_upload(c, shape))
        uploads = {partition_of(r): arrays_of(r, "upload") for r in replies}
        x_up = torch.cat([u["x"].float() for u in uploads.values()])
        y_up = torch.cat([u["y"].long() for u in uploads.values()])

        # 2. the shared denoiser z_w
        t = time.time()
        shared = self.train_shared(x_up, y_up)
        run.phase_seconds["shared-denoiser"] = time.time() - t

        # 3. personalised sampling on the clients (evaluation)
        payload = ArrayRecord(shared.state_dict())
        msgs = make_messages(grid, [r.metadata.src_node_id for r in replies], "query.sample",
                             lambda n: RecordDict({"config": self.run_config_record(), "shared": payload}))
        got = keep_valid(run, grid.send_and_receive(msgs, timeout=cfg.round_timeout), "query.sample",
                         lambda c: check_arrays(c.array_records.get("samples")))
        samples = {partition_of(r): arrays_of(r, "samples") for r in got}
        t = time.time()
        metrics = ev.per_client({p: (s["x"], s["y"]) for p, s in samples.items()})
        # the non-collaborative reference from the same run: each private model alone, T -> 0
        metrics.update(ev.per_client({p: (s["private_only"], s["y"]) for p, s in samples.items()}, prefix="private_only_"))
        for p, s in samples.items():
            ev.save_grid(s["x"], s["y"], f"pfdm_client{p}.png")
            ev.save_grid(s["private_only"], s["y"], f"private_only_client{p}.png")
        metrics.update(self.attacks(ev, shared, uploads, len(nodes)))
        run.phase_seconds["evaluation"] = time.time() - t
        metrics.update({"t0": self.t0, "epsilon": self.privacy["epsilon"], "reference_accuracy": ev.ref_accuracy,
                        "num_uploads": len(x_up)})
        run.out.log_metrics({"phase": "final", **metrics})
        return metrics

    # ---- attacks on what the server holds ----------------------------------------------------------
    def attacks(self, ev: GenerationEval, shared: DDPM, uploads: dict, num_partitions: int) -> dict[str, Any]:
        from fedapp.metrics import mia_figures

        cfg, o = self.run.cfg, self.run.cfg.options
        g = torch.Generator().manual_seed(cfg.seed + 7)
        x_up = torch.cat([u["x"].float() for u in uploads.values()])
        y_up = torch.cat([u["y"].long() for u in uploads.values()])
        n = min(o.attack_samples, len(x_up), len(ev.server.test))
        # MIA on z_w: members = uploads, non-members = held-out test images released the same way
        mi = torch.randperm(len(x_up), generator=g)[:n]
        ni = torch.randperm(len(ev.server.test), generator=g)[:n]
        x_non = privatize(ev.server.test.x[ni], o.clip, self.t0, g)
        t_range = (self.t0, shared.T)
        out = mia_figures(loss_scores(shared, x_up[mi], y_up[mi], t_range, cfg.seed, source_t=self.t0),
                          loss_scores(shared, x_non, ev.server.test.y[ni], t_range, cfg.seed + 1, source_t=self.t0))

        shards = load_partitions(cfg, num_partitions)  # EVALUATION ORACLE (the truth to score against)
        # memorisation: z_w's own generations (T -> t0, then its x0 estimate) vs every client's training image
        y_gen = torch.arange(n) % ev.num_classes
        x_t0 = shared.sample(n, y_gen, t_start=shared.T, t_end=self.t0 + 1, steps=o.sample_steps // 2,
                             generator=torch.Generator().manual_seed(cfg.seed + 8))
        a = shared.abar[self.t0 + 1]
        with torch.no_grad():
            x0_hat = ((x_t0 - (1 - a).sqrt() * shared.eps(x_t0, self.t0 + 1, y_gen)) / a.sqrt()).clamp(-1, 1)
        out.update({f"shared_{k}": v for k, v in memorisation(x0_hat, torch.cat([s.train.x for s in shards])).items()})
        ev.save_grid(x0_hat, y_gen, "shared_only_x0.png")
        out.update(self.reconstruction(ev, uploads, shards))
        return out

    def reconstruction(self, ev: GenerationEval, uploads: dict, shards: list) -> dict[str, float]:
        """Reconstruction attempt: a denoiser trained by the server on its public data (clipped, levels
        (0, t0]) denoises client 0's uploads t0 -> 0. Scored on unit-normalised images: distance to the true
        image vs to a random training image of the same class (labels are public), and how often the true
        image is the nearest of all client 0's training images (chance: 1/n)."""
        cfg, o = self.run.cfg, self.run.cfg.options
        pid = 0 if 0 in uploads else min(uploads)
        up, truth = uploads[pid], shards[pid].train
        n = min(o.attack_samples, len(truth))
        torch.manual_seed(cfg.seed + 9)
        attacker = build_ddpm(cfg.image_size, ev.num_classes, flag=False, channels=o.channels)
        pub = ev.server.public
        train_ddpm(attacker, clip_norm(pub.x, o.clip), pub.y, steps=o.shared_steps, batch=o.batch, lr=o.lr,
                   seed=cfg.seed + 9, t_range=(0, self.t0), device=self.run.device)
        attacker = attacker.cpu()
        g = torch.Generator().manual_seed(cfg.seed + 10)
        idx = torch.randperm(len(truth), generator=g)[:n]
        y = up["y"][idx].long()
        x_hat = attacker.sample(n, y, t_start=self.t0, t_end=0, x_start=up["x"][idx].float(),
                                steps=o.sample_steps, generator=g)
        d_all = torch.cdist(unit(x_hat), unit(truth.x))
        d_true = d_all[torch.arange(n), idx]
        rand = torch.stack([self._same_class_other(truth.y, int(i), g) for i in idx])
        d_rand = d_all[torch.arange(n), rand]
        from fedapp.models.tiny_prior import sample_grid

        k = min(8, n)  # top row: reconstructions, bottom row: the true images
        sample_grid(torch.cat([x_hat[:k], truth.x[idx][:k]]), 2, self.run.out.path("images", "reconstruction.png"))
        return {"recon_true_distance": float(d_true.mean()), "recon_random_distance": float(d_rand.mean()),
                "recon_closer_than_random": float((d_true < d_rand).double().mean()),
                "recon_identified": float((d_all.argmin(1) == idx).double().mean()),
                "recon_identified_chance": 1.0 / len(truth)}

    @staticmethod
    def _same_class_other(y: torch.Tensor, i: int, g: torch.Generator) -> torch.Tensor:
        """A random index of another image with y[i]'s class (i itself if it is alone)."""
        cand = torch.nonzero((y == y[i]) & (torch.arange(len(y)) != i)).flatten()
        return cand[torch.randint(len(cand), (1,), generator=g)][0] if len(cand) else torch.tensor(i)
