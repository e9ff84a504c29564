"""The generation tables' distances on reference-classifier features: the hand-written Frechet distance
against torchmetrics' formula, KID (torchmetrics) at the small n of a minority class, and the keys every
generation evaluation reports."""

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedapp.metrics import (
    diversity_ratio,
    feature_distances,
    frechet_distance,
    intra_class_diversity,
    kernel_distance,
)


def gaussian_features(n: int, d: int, shift: float = 0.0, scale: float = 1.0, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, d)) * scale + shift


@pytest.mark.parametrize("n, d", [(300, 16), (40, 64)])  # (40, 64): a minority class's rank-deficient covariance
def test_frechet_distance_equals_torchmetrics_fid_formula(n, d):
    from torchmetrics.image.fid import _compute_fid

    a, b = gaussian_features(n, d, seed=1), gaussian_features(n, d, shift=0.2, scale=1.3, seed=2)

    def fit(f):
        return torch.tensor(f.mean(0)), torch.tensor(np.cov(f, rowvar=False))

    want = float(_compute_fid(*fit(b), *fit(a)))
    assert want > 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no SciPy sqrtm warnings, singular covariance or not
        got = frechet_distance(b, a)
    assert got == pytest.approx(want, rel=1e-6)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6 * want)


def test_kid_is_about_zero_within_a_distribution_and_positive_across_a_shift():
    real = gaussian_features(400, 64, seed=1)
    same = gaussian_features(40, 64, seed=2)            # ~40 samples, as a minority class gives
    shifted = gaussian_features(40, 64, shift=0.5, seed=3)
    kid_same, std_same = kernel_distance(same, real)
    kid_shift, std_shift = kernel_distance(shifted, real)
    assert kid_shift > 0.1 and kid_shift > 5 * std_shift
    assert abs(kid_same) < 0.05 * kid_shift
    assert std_same > 0 and std_shift > 0
    assert kernel_distance(same, real, seed=5) == kernel_distance(same, real, seed=5)  # subsets are seeded
    with pytest.raises(ValueError):
        kernel_distance(same[:1], real)


def test_generation_eval_reports_kid_and_its_std_beside_the_frechet_distance():
    from fedapp.models.classifier import SmallCNN
    from strategies.generation_eval import GenerationEval

    torch.manual_seed(0)
    ev = GenerationEval.__new__(GenerationEval)  # the scoring alone, without training a reference classifier
    ev.run = SimpleNamespace(cfg=SimpleNamespace(seed=0))
    ev.ref = SmallCNN(4, width=16).eval()
    ev.groups = {"majority": [0, 1, 2], "minority": [3]}
    ev.server = SimpleNamespace(test=SimpleNamespace(x=torch.rand(80, 3, 8, 8) * 2 - 1, y=torch.arange(80) % 4))
    x, y = torch.rand(40, 3, 8, 8) * 2 - 1, torch.arange(40) % 4
    out = ev.distances(x, y)
    for g in ("majority", "minority"):
        for key in (f"{g}_distance", f"{g}_kid", f"{g}_kid_std"):
            assert np.isfinite(out[key]), key
    assert out["mean_kid"] == pytest.approx((out["majority_kid"] + out["minority_kid"]) / 2)
    feats = ev.features(x[y == 3]), ev.features(ev.server.test.x[ev.server.test.y == 3])
    assert out["minority_kid"] == feature_distances("m", *feats)["m_kid"]
    read = ev.ref(x).argmax(1)  # each group's class reading: its own images only, the whole reading their blend
    assert out["minority_sample_accuracy"] == pytest.approx(float((read[y == 3] == 3).float().mean()))
    assert out["majority_sample_accuracy"] == pytest.approx(float((read[y < 3] == y[y < 3]).float().mean()))
    assert out["sample_accuracy"] == pytest.approx((30 * out["majority_sample_accuracy"]
                                                    + 10 * out["minority_sample_accuracy"]) / 40)


def test_intra_class_diversity_is_the_mean_pairwise_distance_and_its_ratio_scales():
    feats = torch.tensor([[0.0, 0.0], [1.0, 0.0], [3.0, 0.0], [5.0, 5.0], [7.0, 7.0]])
    y = torch.tensor([0, 0, 0, 1, 2])
    div = intra_class_diversity(feats, y)
    assert div == {0: pytest.approx((1 + 3 + 2) / 3)}  # class 1 and 2 have one image: no pair
    g = torch.Generator().manual_seed(0)
    real, ry = torch.randn(200, 8, generator=g), torch.arange(200) % 4
    fake = real.clone()
    fake[ry == 1] *= 0.5  # class 1 collapsed to half its spread, the rest a copy of the real data
    r = diversity_ratio(fake, ry, real, ry)
    assert r["per_class"] == {0: pytest.approx(1.0), 1: pytest.approx(0.5), 2: pytest.approx(1.0),
                              3: pytest.approx(1.0)}
    assert r["mean"] == pytest.approx(3.5 / 4)
