"""PFDM's attacks on what its server holds (strategies/pfdm.py runs them after the protocol, as evaluation):

- loss-threshold membership inference on the shared denoiser z_w (members: the uploads; non-members:
  held-out test images released the same way; score: z_w's own training loss);
- a nearest-neighbour memorisation check of z_w's own generations against every client's training image;
- a reconstruction attempt of client 0's images from its uploads, with a denoiser the server trains on
  its public data.

The attack scores themselves (loss_scores, memorisation, unit, mia_figures) are the privacy audit's, one
mechanism for every method: fedapp/audit/. Seeds are fixed offsets of the run seed, so the figures repeat exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from fedapp.audit.scores import loss_scores, memorisation, unit
from fedapp.data import all_client_shards
from fedapp.models.checkpoints import run_train_state
from fedapp.models.ddpm import DDPM, build_ddpm, shared_objective, train_ddpm
from fedapp.privacy import clip_norm, privatize
from fedapp.protocols import pfdm as P
from fedapp.config import RunConfig
from fedapp.server import ServerRun
from strategies.generation_eval import GenerationEval


def attacks(run: ServerRun[P.PFDMOptions], t0: int, ev: GenerationEval, shared: DDPM, uploads: dict,
            union: tuple[torch.Tensor, torch.Tensor], num_partitions: int) -> dict[str, Any]:
    """The three attacks' figures. `uploads`: partition id -> its release {X, Y}; `union`: all of them as (x~, y)."""
    from fedapp.audit.membership import mia_figures

    cfg, o = run.cfg, run.cfg.options
    g = torch.Generator().manual_seed(cfg.seed + 7)
    x_up, y_up = union
    n = min(o.attack_samples, len(x_up), len(ev.server.test))
    # MIA on z_w: members = uploads, non-members = held-out test images released the same way; the
    # score is z_w's own training loss
    mi = torch.randperm(len(x_up), generator=g)[:n]
    ni = torch.randperm(len(ev.server.test), generator=g)[:n]
    x_non = privatize(ev.server.test.x[ni], o.clip, t0, g)
    t_range, source_t = shared_objective(o.shared, t0, shared.T)
    out = mia_figures(loss_scores(shared, x_up[mi], y_up[mi], t_range, cfg.seed, source_t=source_t),
                      loss_scores(shared, x_non, ev.server.test.y[ni], t_range, cfg.seed + 1, source_t=source_t))

    shards = all_client_shards(cfg, num_partitions)  # EVALUATION ORACLE (the truth to score against)
    # memorisation: z_w's own generations vs every client's training image
    y_gen = torch.arange(n) % ev.num_classes
    x0_hat = shared_generation(shared, y_gen, t0, o.shared, o.sample_steps, torch.Generator().manual_seed(cfg.seed + 8))
    out.update({f"shared_{k}": v for k, v in memorisation(x0_hat, torch.cat([s.train.x for s in shards])).items()})
    ev.save_grid(x0_hat, y_gen, "shared_only_x0.png")
    out.update(reconstruction(run, t0, ev, uploads, shards))
    return out


@torch.no_grad()
def shared_generation(shared: DDPM, y: torch.Tensor, t0: int, mode: str, sample_steps: int,
                      g: torch.Generator) -> torch.Tensor:
    """What z_w alone yields. relative: sampled T -> t0 + 1, then its one-step x0 estimate; algorithm2: its
    samples as they are, x~-like (unit-normalised by `memorisation`, so the sqrt(abar_t0) scale is moot)."""
    if mode == "algorithm2":
        return shared.sample(len(y), y, steps=sample_steps // 2, generator=g, clip_x0=False)
    x_t = shared.sample(len(y), y, t_start=shared.T, t_end=t0 + 1, steps=sample_steps // 2, generator=g)
    return shared.x0_estimate(x_t, shared.eps(x_t, t0 + 1, y), t0 + 1).clamp(-1, 1)


def reconstruction(run: ServerRun[P.PFDMOptions], t0: int, ev: GenerationEval, uploads: dict,
                   shards: list) -> dict[str, float]:
    """Reconstruction attempt: a denoiser trained by the server on its public data (clipped, levels
    (0, t0]) denoises client 0's uploads t0 -> 0. Scored on unit-normalised images: distance to the true
    image vs to a random training image of the same class (labels are public), and how often the true
    image is the nearest of all client 0's training images (chance: 1/n)."""
    cfg, o = run.cfg, run.cfg.options
    pid = 0 if 0 in uploads else min(uploads)
    up, truth = uploads[pid], shards[pid].train
    n = min(o.attack_samples, len(truth))
    attacker = public_attacker(cfg, t0, ev.server.public, ev.num_classes, run.device,
                               state=run_train_state(cfg, "attacker"))
    g = torch.Generator().manual_seed(cfg.seed + 10)
    idx = torch.randperm(len(truth), generator=g)[:n]
    x_hat = invert(attacker, up[P.X][idx], up[P.Y][idx], t0, o.sample_steps, g)
    d_all = torch.cdist(unit(x_hat), unit(truth.x))
    d_true = d_all[torch.arange(n), idx]
    rand = torch.stack([same_class_other(truth.y, int(i), g) for i in idx])
    d_rand = d_all[torch.arange(n), rand]
    k = min(8, n)  # top row: reconstructions, bottom row: the true images
    ev.save_rows(torch.cat([x_hat[:k], truth.x[idx][:k]]), 2, "reconstruction.png")
    return {"recon_true_distance": float(d_true.mean()), "recon_random_distance": float(d_rand.mean()),
            "recon_closer_than_random": float((d_true < d_rand).double().mean()),
            "recon_identified": float((d_all.argmin(1) == idx).double().mean()),
            "recon_identified_chance": 1.0 / len(truth)}


def public_attacker(cfg: RunConfig[P.PFDMOptions], t0: int, public: Any, num_classes: int, device: str,
                    state: Any = None) -> DDPM:
    """The reconstruction attacker: a denoiser the server trains on its public data (clipped as the clients
    clip), levels (0, t0], at the shared denoiser's budget and recipe (`state`: train_ddpm's checkpoint). The
    privacy audit (experiments/privacy_audit.py) inverts every client's uploads with it."""
    o = cfg.options
    torch.manual_seed(cfg.seed + 9)
    attacker = build_ddpm(cfg.image_size, num_classes, flag=False, channels=o.channels)
    train_ddpm(attacker, clip_norm(public.x, o.clip), public.y, steps=o.shared_steps, batch=o.batch, lr=o.lr,
               seed=cfg.seed + 9, t_range=(0, t0), device=device, ema=o.ema, p_uncond=o.p_uncond, state=state)
    return attacker.cpu()


@torch.no_grad()
def invert(attacker: DDPM, x_up: torch.Tensor, y_up: torch.Tensor, t0: int, steps: int,
           g: torch.Generator) -> torch.Tensor:
    """Uploads x~ (level t0; their labels travel in the clear) denoised t0 -> 0 by the attacker: its guesses
    of the images."""
    return attacker.sample(len(y_up), y_up.long(), t_start=t0, t_end=0, x_start=x_up.float(), steps=steps,
                           generator=g)


def same_class_other(y: torch.Tensor, i: int, g: torch.Generator) -> torch.Tensor:
    """A random index of another image with y[i]'s class (i itself if it is alone)."""
    cand = torch.nonzero((y == y[i]) & (torch.arange(len(y)) != i)).flatten()
    return cand[torch.randint(len(cand), (1,), generator=g)][0] if len(cand) else torch.tensor(i)
