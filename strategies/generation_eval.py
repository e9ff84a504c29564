"""How pfdm and its generation baselines (local-only, fedavg-ddpm, centralized-ddpm) are scored, on the
server, so that every row of the PFDM table is measured the same way.

- GenerationEval: a reference classifier (SmallCNN on the server's real public split) embeds real test
  images and samples; Frechet distance and KID per class group (majority / minority), NOT Inception; sample
  grids; the loss-threshold membership-inference attack on a model trained on clean data.
- the attack scores the strategies also apply to what they hold (loss_scores, unit, memorisation) are the
  privacy audit's: fedapp/audit/scores.py.
- sample_model: class-balanced samples of a model released as a whole (no private half).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedapp.audit.scores import MEMO_RATIO, loss_scores, memorisation, unit  # noqa: F401 (this module's callers')
from fedapp.data import server_data
from fedapp.images import sample_grid, save_class_grid
from fedapp.models.ddpm import DDPM
from fedapp.protocols.pfdm import PFDMOptions
from fedapp.server import ServerRun

MIA_T_RANGE = (0, 300)  # attacker's levels for a model trained on clean data: small t reveal the most


def sample_model(model: DDPM, n: int, num_classes: int, steps: int, seed: int, guidance: float = 1.0):
    """Class-balanced samples of a (non-private) model over T -> 0 (guidance: classifier-free scale)."""
    y = torch.arange(n) % num_classes
    return model.sample(n, y, steps=steps, generator=torch.Generator().manual_seed(seed), guidance=guidance), y


class GenerationEval:
    """Scores generated samples for one run: a reference classifier (a fedapp.readers reader: a SmallCNN trained
    on the dataset's real images outside its test split) embeds real test images and samples; Frechet distance
    and KID per class group (NOT Inception)."""

    def __init__(self, run: ServerRun[PFDMOptions], num_partitions: int):
        from fedapp.readers import server_reader

        cfg, o = run.cfg, run.cfg.options
        self.run = run
        self.server = server_data(cfg, num_partitions)
        self.num_classes = self.server.info.num_classes
        self.shape = (self.server.info.channels, cfg.image_size, cfg.image_size)  # of every image scored
        meta = self.server.meta
        self.groups = {"majority": meta.get("majority_classes", list(range(self.num_classes))),
                       "minority": meta.get("minority_classes", [])}
        self.reader = server_reader(self.server, cfg.seed, epochs=o.ref_epochs, width=16)
        self.ref = self.reader.model

    def reader_figures(self) -> dict[str, Any]:
        """The summary's reader figures (call once a run: an unreliable reader logs its warning here)."""
        from fedapp.readers import reader_metrics

        return {"reference_accuracy": self.reader.held_out_accuracy, **reader_metrics([self.reader])}

    @torch.no_grad()
    def features(self, x: torch.Tensor) -> np.ndarray:
        return torch.cat([self.ref.embed(x[i:i + 512]) for i in range(0, len(x), 512)]).numpy()

    def distances(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """majority/minority Frechet distance and KID (± its std over subsets) to the real test images of those
        classes; mean = their average (as the paper's tables); sample_accuracy = share the reference classifier
        labels as requested, <group>_sample_accuracy the same over that group's classes (a minority class's
        reading is what collaboration should lift)."""
        from fedapp.metrics import feature_distances
        from fedapp.models.classifier import predict

        right = predict(self.ref, x) == y.cpu()  # the reader runs once; every reading is a share of these
        out = {}
        for name, classes in self.groups.items():
            if not classes:
                continue
            real = self.server.test.x[torch.isin(self.server.test.y, torch.tensor(classes))]
            asked = torch.isin(y, torch.tensor(classes))
            out.update(feature_distances(name, self.features(x[asked]), self.features(real), seed=self.run.cfg.seed))
            out[f"{name}_sample_accuracy"] = float(right[asked].float().mean())
        for metric in ("distance", "kid"):
            out[f"mean_{metric}"] = float(np.mean([out[f"{g}_{metric}"] for g in self.groups
                                                   if f"{g}_{metric}" in out]))
        out["sample_accuracy"] = float(right.float().mean())
        return out

    def save_grid(self, x: torch.Tensor, y: torch.Tensor, name: str, per_class: int = 8) -> str:
        """PNG under images/: one row per class, labelled with its name, as many columns as the rarest class
        fills (at most per_class)."""
        path = self.run.out.path("images", name)
        save_class_grid(x, y, self.num_classes, path, cols=per_class, trim=True,
                        class_names=list(self.server.info.class_names))
        return str(path)

    def save_rows(self, x: torch.Tensor, rows: int, name: str) -> str:
        """PNG under images/ of `x` in `rows` rows (e.g. reconstructions above their true images)."""
        path = self.run.out.path("images", name)
        sample_grid(x, rows, path)
        return str(path)

    def per_client(self, samples: dict[int, tuple[torch.Tensor, torch.Tensor]], prefix: str = "") -> dict[str, Any]:
        """Distances per client; the headline figures are client 0's (the paper reports the first client)."""
        per = {str(pid): self.distances(x, y) for pid, (x, y) in sorted(samples.items())}
        head = per.get("0", next(iter(per.values())))
        out: dict[str, Any] = {f"{prefix}{k}": v for k, v in head.items()}
        out[f"{prefix}per_client"] = per
        return out

    def mia_clean(self, model: DDPM, member_x: torch.Tensor, member_y: torch.Tensor) -> dict[str, float]:
        """Loss-threshold MIA on a model trained on clean data: members = client 0's training images,
        non-members = the server's held-out test images; levels MIA_T_RANGE."""
        from fedapp.audit.membership import mia_figures

        n = min(self.run.cfg.options.attack_samples, len(member_x), len(self.server.test))
        g = torch.Generator().manual_seed(self.run.cfg.seed)
        mi = torch.randperm(len(member_x), generator=g)[:n]
        ni = torch.randperm(len(self.server.test), generator=g)[:n]
        seed = self.run.cfg.seed
        return mia_figures(loss_scores(model, member_x[mi], member_y[mi], MIA_T_RANGE, seed),
                           loss_scores(model, self.server.test.x[ni], self.server.test.y[ni], MIA_T_RANGE, seed + 1))
