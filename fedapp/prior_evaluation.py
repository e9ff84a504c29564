"""How well a built tiny prior draws the prompted class: a reference classifier reads its samples.

It sits above both the prior package and the readers (fedapp.readers), which it uses; the prior package
itself never evaluates (so building a prior never imports the classifiers that read it)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from fedapp.images import sample_grid
from fedapp.models.classifier import accuracy, predict
from fedapp.models.prior.pipeline import load_components
from fedapp.models.prior.samplers import SamplerSettings
from fedapp.models.prior.tiny.train import server_split
from fedapp.models.text import class_prompts


def evaluate_tiny_prior(folder: str | Path, dataset: str, per_class: int = 20,
                        guidances: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0), num_steps: int = 25,
                        seed: int = 0, data=None, test=None, classifier_epochs: int = 30,
                        read_size: int | None = None) -> dict:
    """Share of class-prompted samples that a reference classifier (a fedapp.readers reader trained on the
    dataset's real images outside its test split) labels as the prompted class, per guidance; saves samples.png
    (rows = classes). `data` = (x, y, class_names) replaces those training images, `test` = (x, y) the
    held-out test split. read_size: the side the reader reads at (samples resized to it; default the prior's):
    tiny-sd's 32 px samples read at 28 by the reader that reads the 28 px pixel prior, the same reader."""
    from fedapp.readers import reader, reader_metrics, server_reader

    folder = Path(folder)
    meta = json.loads((folder / "prior_meta.json").read_text())
    read_size = read_size or meta["image_size"]
    t0 = time.time()
    if data is None:
        server = server_split(dataset, read_size, meta["seed"])
        ref, class_names = server_reader(server, seed, epochs=classifier_epochs), list(server.info.class_names)
    else:
        if test is None:
            raise ValueError("evaluate_tiny_prior: `data` needs a held-out `test` to measure its reader on")
        x, y, class_names = data
        ref = reader(dataset, meta["image_size"], seed, epochs=classifier_epochs, num_classes=len(class_names),
                     train=(x, y), test=test)
    ref_seconds = time.time() - t0
    prior = load_components(folder)
    if prior.vae is None:
        recon = {}
    else:  # the prior encodes test images at its own size; the reader reads the result at read_size
        held_out = server_split(dataset, meta["image_size"], meta["seed"]).test if data is None else test
        recon = vae_reconstruction(prior, ref, held_out, read_size)
    prompts = class_prompts(dataset, class_names)
    labels = torch.arange(len(class_names)).repeat_interleave(per_class)
    noise = torch.randn(len(labels), *prior.latent_shape, generator=torch.Generator().manual_seed(seed))
    cond = prior.encode_prompts(prompts)[labels]
    result, best = {}, None
    for g in guidances:
        t1 = time.time()
        out = prior.sample(noise, cond, SamplerSettings(num_steps=num_steps, guidance=g))
        acc = accuracy(ref.model, resized(out.images, read_size), labels)
        result[str(g)] = {"accuracy": round(acc, 4), "seconds": round(time.time() - t1, 1)}
        if best is None or acc > best[1]:
            best = (g, acc, out.images)
    sample_grid(best[2], len(class_names), folder / "samples.png")
    domains = {} if data is not None else domain_readings(prior, dataset, best[2], meta, seed, classifier_epochs,
                                                          read_size)
    readers = [ref, *domains.pop("_readers", [])]
    # Z-sampling at the best guidance (gamma2 = 0, T_z = 800), from the same noise
    t1 = time.time()
    zz = prior.sample(noise, cond, SamplerSettings(sampler="zigzag", num_steps=num_steps, guidance=best[0]))
    zigzag = {"accuracy": round(accuracy(ref.model, resized(zz.images, read_size), labels), 4),
              "unet_evals": zz.unet_evals, "seconds": round(time.time() - t1, 1)}
    return {"sample_accuracy": round(best[1], 4), "sample_guidance": best[0], "accuracy_by_guidance": result,
            "zigzag": zigzag,
            "samples_per_class": per_class, "sample_steps": num_steps,
            "reference_classifier_seconds": round(ref_seconds, 1),
            "reference_classifier": f"SmallCNN, {classifier_epochs} epochs on the real images outside the test split",
            "reference_test_accuracy": round(ref.held_out_accuracy, 4), **recon, **domains,
            **reader_metrics(readers)}


def resized(x: torch.Tensor, size: int) -> torch.Tensor:
    """Images at `size` px (bilinear, antialiased as feddata resizes); unchanged when already there."""
    if x.shape[-1] == size:
        return x
    return torch.nn.functional.interpolate(x.float(), size=(size, size), mode="bilinear", align_corners=False,
                                           antialias=True)


def vae_reconstruction(prior, ref, test, read_size: int, limit: int = 1000) -> dict:
    """A latent prior's VAE round trip D(E(x)) on up to `limit` held-out test images: the reader's accuracy
    on the reconstructions and on the originals (both at read_size), and their mean squared error."""
    x, y = test if isinstance(test, tuple) else (test.x, test.y)
    x, y = x[:limit].float(), y[:limit].long()
    rec = prior.decode_latents(prior.encode_images(x))
    return {"vae_reconstruction_accuracy": round(accuracy(ref.model, resized(rec, read_size), y), 4),
            "vae_original_accuracy": round(accuracy(ref.model, resized(x, read_size), y), 4),
            "vae_reconstruction_mse": round(float((rec - x).pow(2).mean()), 5), "read_at": read_size}


def domain_readings(prior, dataset: str, samples: torch.Tensor, meta: dict, seed: int, epochs: int,
                    read_size: int) -> dict:
    """For a dataset with domains (styles): a domain reader (fedapp.readers, real images outside the test
    split) reads the VAE's reconstructions of held-out images as their own domain (a latent prior only), and
    says which domain each class-prompted sample is drawn in. The prompts name no domain, so the samples
    have no right answer: their spread over domains is the prior's own mix of styles. {} without domains."""
    from feddata import dataset_info
    from fedapp.readers import server_reader

    names = dataset_info(dataset).attributes.get("domain")
    if not names:
        return {}
    server = server_split(dataset, read_size, meta["seed"])
    dom = server_reader(server, seed, "domain", epochs=epochs)
    picked = predict(dom.model, resized(samples, read_size).float())
    out = {"domain_reader_test_accuracy": round(dom.held_out_accuracy, 4),
           "sample_domains": {n: round(float((picked == i).float().mean()), 4) for i, n in enumerate(names)},
           "_readers": [dom]}
    if prior.vae is not None:
        test = server_split(dataset, meta["image_size"], meta["seed"]).test
        x, d = test.x[:1000].float(), torch.as_tensor(test.attrs["domain"][:1000]).long()
        rec = prior.decode_latents(prior.encode_images(x))
        out["vae_reconstruction_domain_accuracy"] = round(accuracy(dom.model, resized(rec, read_size), d), 4)
        out["vae_original_domain_accuracy"] = round(accuracy(dom.model, resized(x, read_size), d), 4)
    return out
