"""How well a built tiny prior draws the prompted class: a reference classifier reads its samples."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from fedapp.images import sample_grid
from ...text import class_prompts
from ..pipeline import load_components
from .train import public_data


def evaluate_tiny_prior(folder: str | Path, dataset: str, per_class: int = 20,
                        guidances: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0), num_steps: int = 25,
                        seed: int = 0, data=None, classifier_epochs: int = 30) -> dict:
    """Share of class-prompted samples that a reference classifier (SmallCNN trained on the real
    public split) labels as the prompted class, per guidance; saves samples.png (rows = classes)."""
    from ...classifier import SmallCNN, accuracy, train_classifier

    folder = Path(folder)
    meta = json.loads((folder / "prior_meta.json").read_text())
    x, y, class_names = data if data is not None else public_data(dataset, meta["image_size"], meta["seed"])
    t0 = time.time()
    torch.manual_seed(seed)
    ref = train_classifier(SmallCNN(len(class_names), in_ch=x.shape[1]), x.float(), y.long(),
                           epochs=classifier_epochs, seed=seed)
    ref_seconds = time.time() - t0
    ref_test = None
    if data is None:  # the reference classifier's own accuracy on real held-out images
        import feddata

        test = feddata.load_server_data(dataset, "iid", {}, meta["seed"], num_partitions=4,
                                        image_size=meta["image_size"]).test
        ref_test = round(accuracy(ref, test.x, test.y), 4)
    prior = load_components(folder)
    prompts = class_prompts(dataset, class_names)
    labels = torch.arange(len(class_names)).repeat_interleave(per_class)
    noise = torch.randn(len(labels), *prior.latent_shape, generator=torch.Generator().manual_seed(seed))
    cond = prior.encode_prompts(prompts)[labels]
    result, best = {}, None
    for g in guidances:
        t1 = time.time()
        out = prior.sample(noise, cond, num_steps=num_steps, guidance=g)
        acc = accuracy(ref, out.images, labels)
        result[str(g)] = {"accuracy": round(acc, 4), "seconds": round(time.time() - t1, 1)}
        if best is None or acc > best[1]:
            best = (g, acc, out.images)
    sample_grid(best[2], len(class_names), folder / "samples.png")
    # Z-sampling at the best guidance (gamma2 = 0, T_z = 800), from the same noise
    t1 = time.time()
    zz = prior.sample(noise, cond, num_steps=num_steps, guidance=best[0], sampler="zigzag")
    zigzag = {"accuracy": round(accuracy(ref, zz.images, labels), 4),
              "unet_evals": zz.unet_evals, "seconds": round(time.time() - t1, 1)}
    return {"sample_accuracy": round(best[1], 4), "sample_guidance": best[0], "accuracy_by_guidance": result,
            "zigzag": zigzag,
            "samples_per_class": per_class, "sample_steps": num_steps, "reference_classifier_seconds": round(ref_seconds, 1),
            "reference_classifier": f"SmallCNN, {classifier_epochs} epochs on the real public split",
            "reference_test_accuracy": ref_test}
