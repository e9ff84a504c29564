"""Evaluation figures shared by every method.

- accuracy, and accuracy per domain when the data has one;
- Frechet distance between Gaussian fits of *reference-classifier* features (the FID
  formula, but not Inception features: Inception weights cannot be downloaded here, so
  the numbers are not comparable with published FIDs and are never called FID);
- KID on the same features (torchmetrics' KernelInceptionDistance): unbiased at small n, where the
  Frechet distance's covariance fit is rank-deficient and its bias dominates;
- composition accuracy: both attributes of a sample read back as requested;
- intra-class diversity: mean pairwise feature distance within each class, and its ratio synthetic /
  real (what a sampler that sharpens class evidence, such as Z-sampling, may trade away).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


@torch.no_grad()
def predict_labels(model: torch.nn.Module, x: torch.Tensor, device: str = "cpu", batch: int = 256) -> torch.Tensor:
    model.to(device).eval()
    return torch.cat([model(x[i : i + batch].to(device)).argmax(1).cpu()
                      for i in range(0, len(x), batch)]) if len(x) else torch.zeros(0, dtype=torch.long)


def accuracy_by_group(model: torch.nn.Module, split: Any, info: Any, device: str = "cpu") -> dict[str, Any]:
    """`accuracy` on the split, plus `domain_accuracy` {name: acc} when it has domains."""
    pred = predict_labels(model, split.x, device)
    correct = (pred == split.y).float()
    out: dict[str, Any] = {"accuracy": correct.mean().item() if len(correct) else float("nan")}
    if "domain" in split.attrs and "domain" in info.attributes:
        names = info.attributes["domain"]
        dom = split.attrs["domain"]
        out["domain_accuracy"] = {names[d]: correct[dom == d].mean().item()
                                  for d in range(len(names)) if (dom == d).any()}
    return out


def trace_sqrt_product(s_a: np.ndarray, s_b: np.ndarray) -> float:
    """Tr((S_a S_b)^{1/2}) of two covariances: the sum of the square roots of the eigenvalues of
    S_a^{1/2} S_b S_a^{1/2}, a symmetric PSD matrix similar to S_a S_b. Two symmetric eigendecompositions
    instead of scipy's sqrtm of the non-symmetric product, which warns (and needed regularising) where a
    covariance is singular: features outnumbering samples, as for a class of few samples."""
    w, v = np.linalg.eigh(s_a)
    root_a = (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T
    lam = np.linalg.eigvalsh(root_a @ s_b @ root_a)
    return float(np.sqrt(np.clip(lam, 0.0, None)).sum())


def frechet_distance(feats_a: np.ndarray, feats_b: np.ndarray) -> float:
    """||mu_a - mu_b||² + Tr(S_a + S_b - 2 (S_a S_b)^{1/2}) of two feature sets (rows = samples)."""
    a = np.asarray(feats_a, dtype=np.float64)
    b = np.asarray(feats_b, dtype=np.float64)
    if len(a) < 2 or len(b) < 2:
        raise ValueError("frechet_distance needs at least two samples per set")
    mu_a, mu_b = a.mean(0), b.mean(0)
    s_a, s_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(s_a) + np.trace(s_b) - 2 * trace_sqrt_product(s_a, s_b))


KID_SUBSETS = 100        # torchmetrics' defaults; the subset size is capped at the smaller set
KID_SUBSET_SIZE = 1000


def kernel_distance(feats_fake: np.ndarray, feats_real: np.ndarray, subsets: int = KID_SUBSETS,
                    subset_size: int = KID_SUBSET_SIZE, seed: int = 0) -> tuple[float, float]:
    """KID of two feature sets (rows = samples): torchmetrics' KernelInceptionDistance (unbiased MMD² with
    the cubic polynomial kernel) fed the precomputed features through an identity extractor, so no
    Inception weights are needed. Subsets of min(n_fake, n_real, subset_size) rows, drawn under `seed`.

    Returns (mean, std): std is torchmetrics' spread of the subset estimates (population std), the
    usual "KID ± std"; it is not divided by sqrt(subsets), since the subsets overlap. When a subset is
    a whole set (small n), that set's own sampling variability is not in it."""
    import warnings

    from torchmetrics.image.kid import KernelInceptionDistance

    fake = torch.as_tensor(np.asarray(feats_fake), dtype=torch.float64)
    real = torch.as_tensor(np.asarray(feats_real), dtype=torch.float64)
    m = min(len(fake), len(real), subset_size)
    if m < 2:
        raise ValueError("kernel_distance needs at least two samples per set")
    with warnings.catch_warnings():  # its "saves all features in a buffer" warning: ours are already in memory
        warnings.simplefilter("ignore", UserWarning)
        kid = KernelInceptionDistance(feature=torch.nn.Identity(), subsets=subsets, subset_size=m)
    kid.update(real, real=True)
    kid.update(fake, real=False)
    with torch.random.fork_rng(devices=[]):  # its subsets come from the global RNG: seed them, leave it as it was
        torch.manual_seed(seed)
        mean, std = kid.compute()
    return float(mean), float(std)


def feature_distances(name: str, feats_fake: np.ndarray, feats_real: np.ndarray, seed: int = 0) -> dict[str, float]:
    """What every generation table reports for one group: {name}_distance (Frechet), {name}_kid, {name}_kid_std."""
    kid, kid_std = kernel_distance(feats_fake, feats_real, seed=seed)
    return {f"{name}_distance": frechet_distance(feats_fake, feats_real), f"{name}_kid": kid,
            f"{name}_kid_std": kid_std}


def intra_class_diversity(feats: torch.Tensor, labels: torch.Tensor, max_per_class: int = 1000,
                          seed: int = 0) -> dict[int, float]:
    """Per class with >= 2 images: the mean Euclidean distance between the features of two different
    images of that class (a seeded subsample of max_per_class images when larger: O(n^2) pairs)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for c in torch.unique(labels).tolist():
        f = feats[labels == c].double()
        if len(f) > max_per_class:
            f = f[torch.randperm(len(f), generator=g)[:max_per_class]]
        if len(f) >= 2:
            out[int(c)] = float(torch.cdist(f, f).sum() / (len(f) * (len(f) - 1)))  # the diagonal is 0
    return out


def diversity_ratio(fake_feats: torch.Tensor, fake_y: torch.Tensor, real_feats: torch.Tensor,
                    real_y: torch.Tensor) -> dict[str, Any]:
    """intra_class_diversity of the synthetic data over the real data's, per class both have (with a
    non-zero real spread), and their mean: 1 = as diverse as the real data, < 1 = collapsed."""
    fake, real = intra_class_diversity(fake_feats, fake_y), intra_class_diversity(real_feats, real_y)
    per = {c: fake[c] / real[c] for c in sorted(fake.keys() & real.keys()) if real[c] > 0}
    return {"per_class": per, "mean": float(np.mean(list(per.values()))) if per else float("nan")}


def composition_accuracy(pred_a: torch.Tensor, pred_b: torch.Tensor,
                         want_a: torch.Tensor, want_b: torch.Tensor) -> float:
    """Share of samples whose two attributes both read back as requested."""
    ok = (pred_a == want_a) & (pred_b == want_b)
    return ok.float().mean().item() if len(ok) else float("nan")


def weighted_client_accuracy(acc: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The clients' test accuracy weighted by their test-set sizes, and per client
    (`acc`: partition id -> {accuracy, n}, as fedapp.protocols.classify.client_accuracies reads it). None when
    the clients hold no test image between them (tiny shards), rather than a 0.0 that reads as a failure."""
    n = sum(v["n"] for v in acc.values())
    return {"client_accuracy": sum(v["accuracy"] * v["n"] for v in acc.values()) / n if n else None,
            "per_client_accuracy": {str(k): v["accuracy"] for k, v in sorted(acc.items())}}
