"""Membership scores of candidate images (a higher score means "member"), one function per kind of thing an
attacker holds, and the memorisation check of generated images.

- a denoiser (a DDPM upload or release): minus its training loss on the candidate (`loss_scores`);
- a classifier (a FedAvg-family upload, a global model): minus its cross-entropy (`classifier_loss_scores`),
  or its logit-scaled confidence (`logit_confidence`) compared with shadow models trained without the candidates
  (`lira_offline`: Carlini et al. 2022's offline likelihood ratio with a variance pooled over candidates);
- generated images (from a generative upload): minus the distance to the nearest one (`nearest_scores`), in
  whatever space the caller embeds both in (a reader's features).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F

from fedapp.models.ddpm import DDPM

MIA_DRAWS = 8  # (t, noise) draws per sample, averaged into one denoiser loss score
MEMO_RATIO = 1 / 3  # memorised: nearest training image < 1/3 of the distance to the second nearest


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


def _logits(model: torch.nn.Module, x: torch.Tensor, batch: int) -> torch.Tensor:
    model.eval()
    device = next(model.parameters()).device
    return torch.cat([model(x[i:i + batch].to(device)).double().cpu() for i in range(0, len(x), batch)])


@torch.no_grad()
def classifier_loss_scores(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 512) -> np.ndarray:
    """Loss-threshold MIA score (Yeom et al. 2018): minus the per-sample cross-entropy."""
    return (-F.cross_entropy(_logits(model, x, batch), y.long(), reduction="none")).numpy()


@torch.no_grad()
def logit_confidence(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 512) -> np.ndarray:
    """LiRA's statistic: log(p_y / (1 - p_y)), computed stably as logit_y - logsumexp(other logits)."""
    z = _logits(model, x, batch)
    y = y.long()
    own = z.gather(1, y[:, None]).squeeze(1)
    others = z.scatter(1, y[:, None], float("-inf")).logsumexp(1)
    return (own - others).numpy()


def lira_offline(target: np.ndarray, shadows: np.ndarray) -> np.ndarray:
    """Offline likelihood-ratio score: how far above what models trained without it give a candidate its
    confidence is, (target - mean_out) / std_out. `shadows`: (S, N) confidences of S shadow models none of which
    trained on the N candidates; per-candidate mean, one standard deviation pooled over candidates (stabler
    than per-candidate at a few shadows)."""
    shadows = np.asarray(shadows, dtype=float)
    if shadows.ndim != 2 or shadows.shape[0] < 2 or shadows.shape[1] != len(target):
        raise ValueError(f"shadows: shape {shadows.shape}; need (S >= 2 shadow models, {len(target)} candidates)")
    std = float(np.sqrt(shadows.var(axis=0, ddof=1).mean()))
    return (np.asarray(target, dtype=float) - shadows.mean(axis=0)) / max(std, 1e-12)


def nearest_distances(candidates: torch.Tensor, reference: torch.Tensor) -> np.ndarray:
    """Each candidate's Euclidean distance to its nearest row of `reference` (both (N, d) features)."""
    return torch.cdist(candidates.double().flatten(1), reference.double().flatten(1)).min(dim=1).values.numpy()


def nearest_scores(candidates: torch.Tensor, generated: torch.Tensor) -> np.ndarray:
    """Nearest-neighbour MIA score on a generative upload: minus the distance to the nearest generated image."""
    return -nearest_distances(candidates, generated)


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
