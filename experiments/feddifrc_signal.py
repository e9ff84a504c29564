"""`python -m experiments feddifrc-signal`: how much class signal FedDifRC's diffusion targets carry.

TDCL pulls a client's embedding z_i toward F~_{i,y} (its image under its own class prompt) and away from
F~_{i,c} (the same image under the other class prompts). That only teaches the classes where the prior's
class prompts move its decoder features: if F~_{i,c} hardly depends on c, TDCL is a constant. Measured on the
targets the table's clients use (the shared public basis, the table's prior), per image:

- `tdcl_floor`: TDCL at the ideal embedding z_i = F~_{i,y}, against `uninformative` = log K (prompts that do
  not differ); a floor near log K means no embedding can satisfy TDCL better than one that ignores it;
- `cos_own_other`: the mean cosine similarity of F~_{i,y} and F~_{i,c}, c != y, with the temperature it is
  read at: TDCL's logits differ by (1 - cos) / tau;
- `prompt_accuracy`: how often the own-class target is the one nearest the image's empty-prompt target H~_i
  (chance 1/K): whether the prior "sees" the class in the image, in the space NDCR pulls toward;
- `probe_accuracy` of H~ and of the mean over prompts of F~: a least-squares linear read-out of the class,
  fitted on a random half of the images and read on the other: class information in NDCR's target itself.

Writes <out>/feddifrc_signal.json. The targets come from clients.feddifrc.compute_targets with the shared memo
of the table (<runs-dir>/shared-targets.pt) where it has them, so images the table has seen cost no UNet pass.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from experiments.cli import common_args, pin_threads
from experiments.common import prog, quiet_logs
from fedapp.results import atomic_write_json


def signal_figures(F_: torch.Tensor, pos: torch.Tensor, H: torch.Tensor, tau: float) -> dict[str, float]:
    """The figures above for targets F_ (N, K, D), own prompt pos (N,), empty-prompt targets H (N, D)."""
    from clients.feddifrc import tdcl_loss

    n, k, _ = F_.shape
    own = F_[torch.arange(n), pos]
    cos = F.cosine_similarity(own.unsqueeze(1), F_, dim=-1)  # (N, K)
    other = cos.masked_fill(F.one_hot(pos, k).bool(), float("nan"))
    nearest = F.cosine_similarity(H.unsqueeze(1), F_, dim=-1).argmax(dim=1)
    return {"tdcl_floor": float(tdcl_loss(own, F_, pos, tau)), "uninformative": math.log(k),
            "cos_own_other": float(other.nanmean()), "tau": tau,
            "prompt_accuracy": float((nearest == pos).float().mean()), "chance": 1 / k,
            "probe_accuracy_H": probe_accuracy(H, pos, k), "probe_accuracy_F_mean": probe_accuracy(F_.mean(1), pos, k)}


def probe_accuracy(x: torch.Tensor, y: torch.Tensor, k: int) -> float:
    """A least-squares linear read-out of y from x (with a bias), fitted on a seeded random half of the rows,
    read on the other half."""
    x = torch.cat([x.double(), torch.ones(len(x), 1, dtype=torch.double)], dim=1)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    fit, read = order[: len(x) // 2], order[len(x) // 2:]
    w = torch.linalg.lstsq(x[fit], F.one_hot(y[fit], k).double(), rcond=None).solution
    return float(((x[read] @ w).argmax(1) == y[read]).float().mean())


def main(argv: list[str]) -> None:
    shared = common_args(dataset="mnist-5k", out="docs/results", runs_dir="runs/feddifrc-table", threads=1,
                         helps={"runs_dir": "where the table keeps shared-targets.pt"})
    p = argparse.ArgumentParser(prog=prog("feddifrc-signal"), description=__doc__.split("\n")[0], parents=[shared])
    p.add_argument("--prior", default="tiny")
    p.add_argument("--clients", default="0,1,2,3,4", help="partitions of the split whose images are read")
    p.add_argument("--alpha", type=float, default=0.1)
    a = p.parse_args(argv)
    pin_threads(a.threads)
    quiet_logs()
    import clients.feddifrc as fdr
    from experiments.feddifrc import load_shared_targets
    from fedapp.client_context import ClientContext
    from fedapp.config import all_defaults, parse_run_config

    fdr.share_targets(True)
    load_shared_targets(Path(a.runs_dir) / "shared-targets.pt")
    cfg = parse_run_config({**all_defaults(), "method": "feddifrc", "dataset": a.dataset, "prior": a.prior,
                            "partitioner.name": "dirichlet", "partitioner.alpha": a.alpha, "partitioner.per-class": 0,
                            "device": "cpu"})
    parts = [fdr.compute_targets(ClientContext(cfg=cfg, partition_id=int(c), num_partitions=10))
             for c in a.clients.split(",")]
    F_, pos, H = (torch.cat([getattr(t, k) for t in parts]) for k in ("F", "pos", "H"))
    figures: dict[str, Any] = {"dataset": a.dataset, "prior": a.prior, "images": len(pos),
                               **signal_figures(F_, pos, H, cfg.options.tau)}
    figures["tdcl_floor_tau_0.5"] = signal_figures(F_, pos, H, 0.5)["tdcl_floor"]  # the ablation row's tau
    out = Path(a.out) / "feddifrc_signal.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, figures)
    for k, v in figures.items():
        print(f"{k:24s} {v:.4f}" if isinstance(v, float) else f"{k:24s} {v}")
    print(f"wrote {out}")
