"""Espresso's condition learning, diagnosed: class and domain fidelity of the C row's synthetic images
for several (embed-steps, embed-lr, embed-batch) settings, and the client seconds each costs.

    python -m experiments espresso-conditions [--settings 100:0.01:32:minibatch 200:0.05:1 ...] \\
        [--clients 0 3] [--inits gaussian gmm] [--sampler ddim|zigzag] [--set dataset=mnist-styles prior=tiny@photo ...]

For each setting and each --inits (gaussian: the C row's N(0, I) noise; gmm: the C+G row's noise drawn
from the client's GMM of forward-diffused latents), each listed client (its shard as the run builds it)
computes its upload (clients/espresso.py, with the setting's learner passed in: `batched` production's
learn_conditions, `minibatch` the learner before batching, experiments/espresso_condition_learners.py),
the server synthesises 1x its data from those conditions with DDIM
(--sampler zigzag: Z-sampling; strategies/espresso.py), and two SmallCNNs trained on real public images
read each image's class and domain (experiments.espresso_ablation: fidelity_readers, fidelity). With
--samplers it also reads class-prompted samples (no learned condition) of the previous and the new sampler
(SAMPLERS), the same noise for each. Writes <out>/espresso_conditions.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from experiments.cli import common_args, pin_threads
from experiments.common import config_errors_exit, parse_set, prog, quiet_logs
from fedapp.options import ConfigError
from fedapp.results import atomic_write_json

DEFAULT_SETTINGS = ["100:0.01:32:minibatch", "100:0.05:1", "200:0.05:1", "400:0.05:1"]
SAMPLERS = {  # name -> SamplerSettings fields: the previous default, the new one, each without and with Z
    "ddim 10 leading": {"sampler": "ddim", "num_steps": 10, "spacing": "leading"},
    "zigzag 10 leading paper": {"sampler": "zigzag", "num_steps": 10, "spacing": "leading"},
    "ddim 50 trailing": {"sampler": "ddim", "num_steps": 50, "spacing": "trailing"},
    "zigzag 50 trailing paper": {"sampler": "zigzag", "num_steps": 50, "spacing": "trailing", "zigzag": "paper"},
    "zigzag 50 trailing official": {"sampler": "zigzag", "num_steps": 50, "spacing": "trailing", "zigzag": "official"},
}


def parse_setting(text: str) -> dict[str, Any]:
    """'steps:lr:batch[:batched|minibatch]' -> {steps, lr, batch, learner}; a ConfigError says the form."""
    from experiments.espresso_condition_learners import LEARNERS

    parts = text.split(":")
    try:
        if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] not in LEARNERS):
            raise ValueError
        return {"steps": int(parts[0]), "lr": float(parts[1]), "batch": int(parts[2]),
                "learner": parts[3] if len(parts) == 4 else "batched"}
    except ValueError:
        raise ConfigError(f"--settings {text!r}: must be steps:lr:batch[:batched|minibatch], e.g. 200:0.05:1") from None


def run_setting(setting: dict[str, Any], cfg, prior, shards: list, prompts: list[str], readers, domains: list[str],
                seed: int, inits: tuple[str, ...] = ("gaussian",), sampler: str = "ddim") -> list[dict[str, Any]]:
    """Fidelity of the images (1x, `sampler`: ddim, or zigzag for the Z rows) from conditions learned with
    `setting`, one row per init: gaussian the C row's, gmm the C+G row's. Each client learns its conditions
    once (they do not depend on the init: the GMM is fitted after them) and the server synthesises from them
    with each init."""
    from clients import espresso as client
    from experiments.espresso_ablation import fidelity
    from experiments.espresso_condition_learners import LEARNERS
    from strategies import espresso as server

    opts = dataclasses.replace(cfg.options, init="gmm" if "gmm" in inits else "gaussian", sampler=sampler,
                               ratio=1.0, embed_steps=setting["steps"], embed_lr=setting["lr"],
                               embed_batch=setting["batch"], gamma1=server.P.guidance(cfg.options, cfg))
    synth: dict[str, list] = {init: [] for init in inits}
    seconds = []
    prompt_cond = prior.encode_prompts(prompts).float().cpu()
    for sh in shards:
        t0 = time.time()
        up = client.espresso_upload(prior, sh.train.x, sh.train.y, num_classes=len(prompts), prompts=prompts,
                                    opts=opts, seed=seed, learner=LEARNERS[setting["learner"]])
        seconds.append(round(time.time() - t0, 1))
        for init in inits:
            synth[init].append(server.synthesize_client(prior, up, dataclasses.replace(opts, init=init),
                                                        prompt_cond, seed)[:2])
    own = [domains.index(sh.meta["domain"]) for sh in shards]
    return [{**setting, "init": init, "sampler": sampler, **fidelity(readers, synth[init], own),
             "client_seconds": seconds} for init in inits]


def sampler_rows(prior, prompts: list[str], readers, n: int, guidance: float, seed: int,
                 samplers: dict[str, dict] = SAMPLERS) -> dict[str, dict[str, Any]]:
    """Class fidelity and the domains read of n class-prompted samples (n / K per class) per sampler."""
    import torch

    from fedapp.models.classifier import predict
    from fedapp.models.prior.samplers import SamplerSettings

    y = torch.arange(n) % len(prompts)
    cond = prior.encode_prompts(prompts)[y]
    noise = torch.randn(n, *prior.latent_shape, generator=torch.Generator().manual_seed(seed))
    out = {}
    for name, kw in samplers.items():
        x = prior.sample(noise, cond, SamplerSettings(guidance=guidance, zigzag_t=800, gamma2=0.0, **kw)).images.float()
        out[name] = {"class_fidelity": float((predict(readers["class"], x) == y).float().mean()),
                     "domains_read": torch.bincount(predict(readers["domain"], x), minlength=4).tolist()}
    return out


def main(argv: list[str]) -> None:
    shared = common_args(set=[], out="docs/results", threads=1,
                         helps={"set": "run-config overrides, e.g. dataset=mnist-styles",
                                "out": "folder for espresso_conditions.json"})
    p = argparse.ArgumentParser(prog=prog("espresso-conditions"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, parents=[shared])
    p.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, help="steps:lr:batch[:batched|minibatch]")
    p.add_argument("--clients", type=int, nargs="+", default=[0, 3], help="partition ids (domain partitioner: "
                                                                          "0 photo, 3 quickdraw)")
    p.add_argument("--inits", nargs="+", default=["gaussian"], choices=["gaussian", "gmm"],
                   help="the synthesis noise each setting is read with: gaussian (the C row), gmm (C+G)")
    p.add_argument("--sampler", default="ddim", choices=["ddim", "zigzag"],
                   help="the sampler each setting's images are drawn with: ddim (C, C+G) or zigzag (the Z rows: "
                        "Z-sampling at espresso.steps and espresso.zigzag-t)")
    p.add_argument("--num-clients", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reader-epochs", type=int, default=20)
    p.add_argument("--samplers", type=int, default=0, metavar="N",
                   help="also read N class-prompted samples of each sampler in SAMPLERS (0: skip)")
    a = p.parse_args(argv)
    pin_threads(a.threads)
    with config_errors_exit():
        settings = [parse_setting(s) for s in a.settings]
        if not all(0 <= k < a.num_clients for k in a.clients):
            raise ConfigError(f"--clients {a.clients}: partition ids must be in [0, {a.num_clients})")
        from experiments.espresso_ablation import diagnostic_config

        cfg = diagnostic_config(a.seed, a.num_clients, parse_set(a.set), "runs/espresso-conditions")
    import torch

    from experiments.espresso_ablation import fidelity_readers
    from fedapp.data import client_shard, server_data
    from fedapp.models.prior import load_or_build_prior
    from fedapp.models.text import class_prompts

    quiet_logs()
    srv = server_data(cfg, a.num_clients)
    shards = [client_shard(cfg, k, a.num_clients) for k in a.clients]  # ORACLE: the diagnostic reads their truth
    readers = fidelity_readers(srv, a.seed, a.reader_epochs)
    prior = load_or_build_prior(cfg.prior, cfg.dataset)
    prompts = class_prompts(cfg.dataset, srv.info.class_names)
    domains = list(srv.info.attributes["domain"])
    rows = []
    for s in settings:
        for r in run_setting(s, cfg, prior, shards, prompts, readers, domains, a.seed, tuple(a.inits), a.sampler):
            rows.append(r)
            print(f"{r['steps']}:{r['lr']}:{r['batch']}:{r['learner']} {r['init']} {r['sampler']}  "
                  f"class {100 * r['class_fidelity']:.1f}%  domain {100 * r['domain_fidelity']:.1f}%  "
                  f"client s {r['client_seconds']}", flush=True)
    samplers = {}
    if a.samplers:
        from strategies.espresso import P

        samplers = sampler_rows(prior, prompts, readers, a.samplers, P.guidance(cfg.options, cfg), a.seed)
        for name, r in samplers.items():
            print(f"{name}: class {100 * r['class_fidelity']:.1f}%  domains read {r['domains_read']}", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "espresso_conditions.json", {
        "setting": {"dataset": cfg.dataset, "prior": cfg.prior, "clients": [sh.meta.get("domain") for sh in shards],
                    "seed": a.seed, "reader_epochs": a.reader_epochs},
        "readers": {k: v for k, v in readers.items() if not isinstance(v, torch.nn.Module)}, "rows": rows,
        "samplers": samplers})
