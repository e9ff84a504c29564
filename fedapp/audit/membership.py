"""A membership attack's figures from its scores: a higher score means "member".

AUC is the area under sklearn's roc_curve (sklearn.metrics.auc: what roc_auc_score computes). TPR at a
false-positive rate is read off the same curve without interpolation: the highest TPR of a threshold whose FPR
is at most the target (Carlini et al. 2022's convention). With n non-members the smallest FPR above zero is
1/n, so below n = 100 the TPR at 1 % FPR is the TPR at zero false positives.
Intervals: a percentile bootstrap that resamples members and non-members separately (their counts stay fixed),
seeded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

TARGET_FPR = 0.01
RESAMPLES = 1000  # bootstrap resamples
LEVEL = 0.95  # two-sided interval


def _labelled(member: np.ndarray, nonmember: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    member, nonmember = np.asarray(member, dtype=float).ravel(), np.asarray(nonmember, dtype=float).ravel()
    if len(member) == 0 or len(nonmember) == 0:
        raise ValueError(f"membership scores: {len(member)} members and {len(nonmember)} non-members; "
                         "need at least one of each")
    if not (np.isfinite(member).all() and np.isfinite(nonmember).all()):
        raise ValueError("membership scores: must be finite (a NaN or inf score has no rank)")
    return np.concatenate([np.ones(len(member)), np.zeros(len(nonmember))]), np.concatenate([member, nonmember])


def tpr_at_fpr(labels: np.ndarray, scores: np.ndarray, fpr: float = TARGET_FPR) -> float:
    """The highest true-positive rate of a threshold whose false-positive rate is at most `fpr`."""
    from sklearn.metrics import roc_curve

    f, t, _ = roc_curve(labels, scores)
    return float(t[f <= fpr].max())  # roc_curve starts at (0, 0): never empty


def mia_figures(member_scores: np.ndarray, nonmember_scores: np.ndarray) -> dict[str, float]:
    """ROC AUC, the best balanced attack accuracy over thresholds, and TPR at TARGET_FPR."""
    from sklearn.metrics import auc, roc_curve

    lab, s = _labelled(member_scores, nonmember_scores)
    fpr, tpr, _ = roc_curve(lab, s)  # one curve for the three figures (the bootstrap calls this 1,000 times)
    return {"mia_auc": float(auc(fpr, tpr)), "mia_attack_accuracy": float(np.max(0.5 * (tpr + 1 - fpr))),
            "mia_tpr_at_1fpr": float(tpr[fpr <= TARGET_FPR].max())}


def bootstrap_figures(member_scores: np.ndarray, nonmember_scores: np.ndarray, *, seed: int = 0,
                      resamples: int = RESAMPLES, level: float = LEVEL) -> dict[str, Any]:
    """mia_figures on the scores as measured, each with its percentile bootstrap interval:
    {figure: {"value", "low", "high"}}, plus the counts and the smallest FPR step (1 / non-members)."""
    member, nonmember = np.asarray(member_scores, float).ravel(), np.asarray(nonmember_scores, float).ravel()
    point = mia_figures(member, nonmember)
    rng = np.random.default_rng(seed)
    draws: dict[str, list[float]] = {k: [] for k in point}
    for _ in range(resamples):
        m = member[rng.integers(0, len(member), len(member))]
        n = nonmember[rng.integers(0, len(nonmember), len(nonmember))]
        for k, v in mia_figures(m, n).items():
            draws[k].append(v)
    tail = 100 * (1 - level) / 2
    out: dict[str, Any] = {k: {"value": v, "low": float(np.percentile(draws[k], tail)),
                               "high": float(np.percentile(draws[k], 100 - tail))} for k, v in point.items()}
    out.update(members=len(member), nonmembers=len(nonmember), fpr_step=1.0 / len(nonmember))
    return out


def strongest(cell: dict[str, Any]) -> dict[str, Any] | None:
    """The attack with the highest AUC in an audit cell ({"attacks": {name: bootstrap_figures}}): the privacy
    column's figure (the weakest defence shown), read by the audit and the leaderboard alike."""
    attacks = cell.get("attacks", {})
    if not attacks:
        return None
    name = max(attacks, key=lambda k: attacks[k]["mia_auc"]["value"])
    f = attacks[name]
    return {"attack": name, "auc": f["mia_auc"]["value"], "low": f["mia_auc"]["low"], "high": f["mia_auc"]["high"],
            "tpr": f["mia_tpr_at_1fpr"]["value"]}
