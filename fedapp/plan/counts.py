"""The classification methods' work, counted from the run config and the data facts with the code's own
constants and formulas: the FedAvg family (fedavg, fedprox, moon, feddifrc), the one-shot methods
(espresso, prompts, class-embed, centralized). The generative methods are in generative.py.

Every counter takes (ledger, cfg, facts, arch) and adds its terms (fedapp/plan/ledger.py) and the module
specs the benchmark builds (`ledger.modules`).
"""

from __future__ import annotations

import dataclasses
import importlib

from fedapp.plan.ledger import Ledger, batches

EVAL_BATCH = 256  # clients.classify.evaluate and fedapp.metrics.predict_labels
SERVER_BATCH = 64  # fedapp.models.classifier.train_classifier: the one-shot methods' server classifier
VAE_BATCH = 16  # Prior.vae_batch
FEATURE_BATCH = 64  # UNetFeatureExtractor's default batch


def sampled(nodes: int, fraction: float, min_nodes: int) -> int:
    """Nodes Flower's FedAvg samples a round: int(nodes x fraction), at least min-nodes, at most all."""
    return min(nodes, max(int(nodes * fraction), min_nodes))


def classifier_spec(led: Ledger, cfg, facts, **extra) -> dict:
    return {"kind": "classifier", "model": classifier_name(led, cfg.model), "num_classes": facts.num_classes,
            "image_size": cfg.classifier_size, "channels": facts.channels, **extra}


def classifier_name(led: Ledger, name: str) -> str:
    """The classifier the plan builds: a built-in, or a transformers ResNet folder or id in the local cache;
    an id that is not (the planner never asks the hub) is planned as the built-in ResNet of its depth."""
    from pathlib import Path

    from huggingface_hub import try_to_load_from_cache

    from fedapp.models.classifier import CNNS, RESNET_DEPTHS

    if name in CNNS or name in RESNET_DEPTHS or Path(name).expanduser().is_dir():
        return name
    try:
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # a malformed id: not cached
        cached = False
    if cached:
        return name
    stand_in = "resnet10" if "10" in name.replace("100", "") else "resnet18"
    led.note(f"model={name!r} is not in the local Hugging Face cache: planned as the built-in {stand_in}")
    return stand_in


def evaluation_rounds(cfg) -> int:
    r = cfg.num_server_rounds
    return sum(1 for k in range(1, r + 1) if k % cfg.evaluate_every == 0 or k == r)


def round_based(led: Ledger, cfg, facts, arch=None, module: str = "classifier", extra_forwards: int = 0) -> None:
    """FedAvg's rounds: local SGD on the sampled clients, evaluation rounds, the global test set after every
    round and before the first (Flower's evaluate_fn at round 0). `extra_forwards`: no-grad forwards a step
    adds from round 2 on (MOON: the global and the previous model)."""
    led.modules.setdefault(module, classifier_spec(led, cfg, facts))
    n, rounds = facts.num_clients, cfg.num_server_rounds
    share = sampled(n, cfg.fraction_train, cfg.min_clients) / n
    for k, count in enumerate(facts.n_train):
        led.add_batched("local SGD steps", module, "train", count, cfg.batch_size, cfg.local_epochs * rounds * share, k)
        if extra_forwards:
            led.add_batched("MOON: global + previous model forwards", module, "infer", count, cfg.batch_size,
                            extra_forwards * cfg.local_epochs * (rounds - 1) * share, k)
    e_share = sampled(n, cfg.fraction_evaluate, cfg.min_clients) / n if cfg.fraction_evaluate > 0 else 0.0
    for k, count in enumerate(facts.n_test):
        led.add_batched("client evaluation", module, "infer", count, EVAL_BATCH, evaluation_rounds(cfg) * e_share, k)
    led.add_batched("global test set", module, "infer", facts.server_test, EVAL_BATCH, rounds + 1)


def moon(led: Ledger, cfg, facts, arch=None) -> None:
    led.modules["classifier"] = classifier_spec(led, cfg, facts, proj_dim=cfg.options.proj_dim)
    round_based(led, cfg, facts, extra_forwards=2)


def oneshot_evaluation(led: Ledger, cfg, facts) -> None:
    """The evaluate phase (every client tests the server's classifier) and the server's global test set."""
    for k, count in enumerate(facts.n_test):
        led.add_batched("client evaluation", "classifier", "infer", count, EVAL_BATCH, 1, k)
    led.add_batched("global test set", "classifier", "infer", facts.server_test, EVAL_BATCH, 1)


def server_classifier(led: Ledger, cfg, facts, images: int, what: str) -> None:
    led.modules.setdefault("classifier", classifier_spec(led, cfg, facts))
    led.add_batched(what, "classifier", "train", images, SERVER_BATCH, cfg.server_epochs)
    oneshot_evaluation(led, cfg, facts)


def centralized(led: Ledger, cfg, facts, arch=None) -> None:
    server_classifier(led, cfg, facts, sum(facts.n_train), "server classifier on the union (oracle)")


# ---- Espresso and its baselines -------------------------------------------------------------------
def strategy_module(method: str):
    """The method's strategy module, loaded by name as fedapp.registry loads it (its own formulas)."""
    from fedapp import registry

    return importlib.import_module(registry.METHODS[method].strategy.partition(":")[0])


def espresso_options(cfg):
    """The options a run of cfg.method uses: its baseline's pinned switches and gamma1 resolved."""
    from fedapp import registry
    from fedapp.protocols import espresso as P

    fixed = getattr(registry.strategy_class(cfg.method), "FIXED", {})
    opts = dataclasses.replace(cfg.options, **fixed)
    return dataclasses.replace(opts, gamma1=P.guidance(opts, cfg))


def condition_rows(counts: list[int], opts) -> tuple[int, int]:
    """(conditions E, rows of one condition-learning step) of a client: min(J, n_y) clusters per class
    (one per class for conditions=class), min(embed-batch, |cluster|) rows each (clusters taken as even)."""
    if opts.conditions == "prompts":
        return 0, 0
    per_class = opts.clusters if opts.conditions == "cluster" else 1
    conditions = rows = 0
    for n in (c for c in counts if c > 0):
        k = min(per_class, n)
        sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
        conditions += k
        rows += sum(min(opts.embed_batch, s) for s in sizes)
    return conditions, rows


def sampler_calls(opts, arch) -> list[int]:
    """Rows per UNet call, in units of the batch, of one sampler call (Prior.sample): e(gamma1) a step
    (2 with CFG: both branches in one call), and on a zigzag step e(gamma2) + e(gamma1) more
    (fedapp.models.prior.samplers); they sum to expected_unet_evals."""
    from fedapp.models.prior.samplers import evals_per_prediction, schedule, zigzag_steps

    ts = schedule(opts.steps, arch.num_train_timesteps, arch.steps_offset, opts.spacing)
    e1, e2 = evals_per_prediction(opts.gamma1), evals_per_prediction(opts.gamma2)
    zig = zigzag_steps(ts, opts.zigzag_t, opts.zigzag).tolist() if opts.sampler == "zigzag" else [False] * len(ts)
    calls = []
    for z in zig:
        calls += [e1, e2, e1] if z else [e1]
    return calls


def num_synthetic(cfg, opts, facts) -> list[int]:
    """Images the server synthesises per client: the strategy's images_per_class (ratio x n_y, at least 1)."""
    import torch

    per_class = strategy_module(cfg.method).images_per_class
    return [sum(per_class(torch.tensor(c), opts.ratio).values()) for c in facts.class_counts]


def prior_modules(led: Ledger, arch) -> None:
    led.modules["prior.unet"] = {"kind": "prior.unet", "arch": arch}
    if arch.vae:
        led.modules["prior.vae.encode"] = {"kind": "prior.vae.encode", "arch": arch}
        led.modules["prior.vae.decode"] = {"kind": "prior.vae.decode", "arch": arch}


def encode(led: Ledger, arch, n: int, what: str, client: int, times: float = 1.0) -> None:
    """E(x) of n images (Prior.encode_images: VAE_BATCH at a time; the identity in pixel space)."""
    if arch.vae:
        led.add_batched(what, "prior.vae.encode", "infer", n, VAE_BATCH, times, client)


def espresso_client(led: Ledger, cfg, opts, arch, k: int, counts: list[int]) -> None:
    """clients.espresso.espresso_upload: E(x), DIFT features for clustering, condition learning, GMMs."""
    from fedapp.protocols import espresso as P

    n = sum(counts)
    if not P.needs_prior(opts):
        return
    encode(led, arch, n, "client: encode images E(x)", k)
    if opts.conditions == "cluster":
        if opts.features == "unet":
            for count, rows in batches(n, FEATURE_BATCH):
                led.add("client: clustering features (DIFT)", "prior.unet", "infer", rows, count, k)
                encode(led, arch, rows, "client: clustering features (DIFT)", k, count)
        else:
            led.note(f"espresso.features={opts.features!r}: the vision backbone's feature pass is not counted")
    _, rows = condition_rows(counts, opts)
    chunk = opts.condition_chunk if 0 < opts.condition_chunk < rows else max(rows, 1)  # rows per UNet call
    for part_rows, calls in ((chunk, rows // chunk), (rows % chunk, 1)):
        led.add("client: condition learning (Eq. 8)", "prior.unet", "grad-input", part_rows,
                opts.embed_steps * calls, k)
    if opts.init == "gmm":
        led.modules["gmm"] = {"kind": "gmm", "dim": arch.latent_dim, "components": opts.gmm_components}
        fits = sum(1 for c in counts if c > 0)
        led.add("client: noise GMM fits", "gmm", "infer", opts.mixup_pairs * opts.diffusions_per_latent, fits, k)


def espresso(led: Ledger, cfg, facts, arch) -> None:
    """Espresso, prompts, class-embed: the clients' uploads, the server's synthesis (sampler calls of
    synth-batch images across clients, each its UNet calls) and classifier, the evaluate phase."""
    opts = espresso_options(cfg)
    prior_modules(led, arch)
    for k, counts in enumerate(facts.class_counts):
        espresso_client(led, cfg, opts, arch, k, counts)
    per_client = num_synthetic(cfg, opts, facts)
    images = sum(per_client)
    led.figures["images synthesised"] = images
    led.figures["images synthesised per client"] = per_client
    led.figures["conditions per client"] = [condition_rows(c, opts)[0] for c in facts.class_counts]
    led.figures["UNet evaluations per image"] = sum(sampler_calls(opts, arch))
    for count, rows in batches(images, opts.synth_batch):
        for factor in sampler_calls(opts, arch):
            led.add("server: synthesis UNet calls", "prior.unet", "infer", rows * factor, count)
        if arch.vae:
            led.add_batched("server: decode latents", "prior.vae.decode", "infer", rows, VAE_BATCH, count)
    led.note("text encoder calls (prompts, once per client and run) are not counted: milliseconds")
    server_classifier(led, cfg, facts, images, "server classifier on the synthetic set")


def feddifrc(led: Ledger, cfg, facts, arch) -> None:
    """FedAvg's rounds on the projected classifier, plus each client's diffusion targets: one UNet pass per
    image and prompt (the class prompts + NDCR's), computed once; the PCA basis on FIT_IMAGES images under
    every prompt, two passes (components, then scales): once per process (pca-fit public) or per client."""
    from fedapp import registry

    o = cfg.options
    targets = importlib.import_module(registry.METHODS[cfg.method].client).T  # clients.feddifrc_targets
    spec = classifier_spec(led, cfg, facts, keep_embedding=True)
    dims = o.target_dims(arch.num_up_blocks, embedding_size(spec["model"]))
    spec["proj_dim"] = sum(dims) if o.feature_on == "head" else 0
    led.modules["classifier"] = spec
    prior_modules(led, arch)
    round_based(led, cfg, facts)
    prompts = facts.num_classes + (0 if o.labels else 1)  # TDCL's; NDCR's one more below
    fit_rows = [min(targets.FIT_IMAGES, facts.public)] if o.pca_fit == "public" else \
        [min(targets.FIT_IMAGES, n) for n in facts.n_train]
    for k, m in enumerate(fit_rows):
        diffusion_passes(led, arch, "client: PCA basis of the targets", m, 2 * (prompts + 1), k)
    if o.pca_fit == "public":
        led.note("feddifrc: the public PCA basis is fitted once per process (counted once, on client 0)")
    share = sampled(facts.num_clients, cfg.fraction_train, cfg.min_clients) / facts.num_clients
    for k, n in enumerate(facts.n_train):
        diffusion_passes(led, arch, "client: diffusion targets (once)", n, prompts + 1, k)
        if o.dynamic_condition > 0 and o.lambda_tdcl > 0:
            rounds = cfg.num_server_rounds * share
            diffusion_passes(led, arch, "client: dynamic-condition targets", n, prompts * rounds, k)


def diffusion_passes(led: Ledger, arch, what: str, n: int, times: float, client: int) -> None:
    """`times` DIFT passes over n images (UNetFeatureExtractor.maps: E(x), then one UNet call a batch)."""
    for count, rows in batches(n, FEATURE_BATCH):
        led.add(what, "prior.unet", "infer", rows, count * times, client)
        encode(led, arch, rows, what, client, count * times)


def embedding_size(model: str) -> int:
    from fedapp.models.classifier import embedding_dim

    return embedding_dim(model)
