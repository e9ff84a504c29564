"""Can a latent prior's autoencoder carry every client style? D(E(x)) of held-out real test images, per
domain, read by the Espresso ablation's class and domain readers (trained on real images outside the test
split; experiments.espresso_ablation.fidelity_readers).

    python -m experiments vae-round-trip --priors tiny-sd@photo <folder> ... [--set dataset=mnist-styles]

A style that comes back read as another domain cannot be drawn by that prior, whatever its conditions or
initial noise: the measurement behind `vae_domains` (fedapp/models/prior/tiny/cache.py). Writes
<out>/vae_round_trip.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from experiments.cli import common_args, pin_threads
from experiments.common import config_errors_exit, parse_set, prog, quiet_logs
from fedapp.results import atomic_write_json

CLIENTS = 4  # the table's domain partition: one client per style


def round_trip(prior, readers: dict[str, Any], x: torch.Tensor, y: torch.Tensor, domain: torch.Tensor,
               names: list[str]) -> dict[str, dict[str, Any]]:
    """Per domain: how the domain reader reads the round trip (counts per domain), the class reader's accuracy
    on it and on the originals, and the round trip's mean squared error."""
    from fedapp.models.classifier import predict

    out = {}
    for d, name in enumerate(names):
        xd, yd = x[domain == d], y[domain == d]
        with torch.no_grad():
            rec = prior.decode_latents(prior.encode_images(xd)).float().clamp(-1, 1)
        read = predict(readers["domain"], rec)
        out[name] = {"images": len(xd),
                     "domains_read": dict(zip(names, torch.bincount(read, minlength=len(names)).tolist())),
                     "own_domain": float((read == d).float().mean()),
                     "class_accuracy": float((predict(readers["class"], rec) == yd).float().mean()),
                     "original_class_accuracy": float((predict(readers["class"], xd) == yd).float().mean()),
                     "mse": float((rec - xd).pow(2).mean())}
    return out


def parser() -> argparse.ArgumentParser:
    shared = common_args(set=["dataset=mnist-styles"], out="docs/results", threads=1,
                         helps={"set": "run-config overrides (the dataset)", "out": "folder for vae_round_trip.json"})
    p = argparse.ArgumentParser(prog=prog("vae-round-trip"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, parents=[shared])
    p.add_argument("--priors", nargs="+", default=["tiny-sd@photo"],
                   help="latent prior specs or SD-layout folders (each must have a VAE)")
    p.add_argument("--per-domain", type=int, default=300, help="held-out test images per domain")
    p.add_argument("--reader-seed", type=int, default=0)
    p.add_argument("--reader-epochs", type=int, default=15)
    return p


def main(argv: list[str]) -> None:
    a = parser().parse_args(argv)
    pin_threads(a.threads)
    with config_errors_exit():
        from experiments.espresso_ablation import diagnostic_config

        # the first prior decides the image size (and so the readers' and test images'), as in a run
        cfg = diagnostic_config(a.reader_seed, CLIENTS, {"prior": a.priors[0], **parse_set(a.set)},
                                "runs/vae-round-trip")
    from experiments.espresso_ablation import fidelity_readers
    from fedapp.data import server_data
    from fedapp.models.prior import load_or_build_prior

    quiet_logs()
    srv = server_data(cfg, CLIENTS)
    readers = fidelity_readers(srv, a.reader_seed, a.reader_epochs)
    names = list(srv.info.attributes["domain"])
    dom = srv.test.attrs["domain"]
    keep = torch.cat([torch.nonzero(dom == d).flatten()[:a.per_domain] for d in range(len(names))])
    results = {}
    for spec in a.priors:
        prior = load_or_build_prior(spec, cfg.dataset)
        if prior.vae is None or prior.image_size != cfg.image_size:
            raise SystemExit(f"--priors {spec!r}: allowed latent priors (with a VAE) of {cfg.image_size} px images, "
                             f"the first prior's size; this one: {prior.image_size} px, VAE {prior.vae is not None}")
        results[spec] = round_trip(prior, readers, srv.test.x[keep], srv.test.y[keep], dom[keep], names)
        for name, r in results[spec].items():
            print(f"{spec} {name:9s} own domain {100 * r['own_domain']:5.1f}%  class {100 * r['class_accuracy']:5.1f}% "
                  f"(originals {100 * r['original_class_accuracy']:.1f}%)  mse {r['mse']:.4f}  {r['domains_read']}",
                  flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "vae_round_trip.json", {
        "setting": {"dataset": cfg.dataset, "per_domain": a.per_domain, "reader_seed": a.reader_seed,
                    "reader_epochs": a.reader_epochs},
        "readers": {k: v for k, v in readers.items() if not isinstance(v, torch.nn.Module)},
        "priors": results})
