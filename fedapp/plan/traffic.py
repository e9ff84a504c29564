"""Each method's messages, from its protocol module's phases and upload schema (fedapp/protocols/*.py):
what fedapp/plan/comm.py counts in bytes. One function per protocol family, as the strategies send them.
"""

from __future__ import annotations

from fedapp.plan.comm import Comm, arrays
from fedapp.plan.counts import espresso_options, evaluation_rounds, sampled
from fedapp.plan.modules import packed_bytes, state_bytes


def _shares(cfg, facts) -> tuple[float, float]:
    n = facts.num_clients
    train = sampled(n, cfg.fraction_train, cfg.min_clients) / n
    evaluate = sampled(n, cfg.fraction_evaluate, cfg.min_clients) / n if cfg.fraction_evaluate > 0 else 0.0
    return train, evaluate


def rounds(comm: Comm, cfg, facts, modules: dict) -> None:
    """FedAvg's loop: the model down and up each round (the run config carrying server-round, and FedProx's
    proximal-mu); each evaluation round the model down and the accuracy up."""
    from fedapp import registry
    from fedapp.protocols import EVALUATE, PROXIMAL_MU_KEY, ROUND_KEY

    model = packed_bytes(modules["classifier"])  # one float32 Array (fedapp.protocols.weights)
    train, evaluate = _shares(cfg, facts)
    extra = {ROUND_KEY: 0, **({PROXIMAL_MU_KEY: cfg.options.mu} if cfg.method == "fedprox" else {})}
    comm.exchange(registry.protocol(cfg.method).TRAIN, {"model": model}, {"model": model},
                  cfg.num_server_rounds * train, config=extra)
    comm.exchange(EVALUATE, {"model": model}, {}, evaluation_rounds(cfg) * evaluate, config={ROUND_KEY: 0})


def oneshot_evaluate(comm: Comm, cfg, modules: dict, config: dict | None = None, share: float = 1.0) -> None:
    """The classifier down to `share` of the clients (Espresso's espresso.evaluate-clients: a sample)."""
    from fedapp.protocols import EVALUATE

    comm.exchange(EVALUATE, {"model": packed_bytes(modules["classifier"])}, {}, share, config=config)


def espresso_upload_bytes(opts, arch, counts: list[int]) -> int:
    """A client's upload at the schema's shapes (fedapp.protocols.espresso.expected_shapes) and dtypes."""
    import torch

    from fedapp.plan.counts import condition_rows
    from fedapp.protocols import espresso as P

    k, classes = len(counts), sum(1 for c in counts if c > 0)
    e, _ = condition_rows(counts, opts)
    sizes = {P.CLASS_COUNTS: (k,), P.EMBEDDINGS: (e, *arch.cond_shape), P.EMBEDDING_CLASS: (e,),
             P.CLUSTER_SIZES: (e,), P.GMM_CLASS: (classes,), P.GMM_WEIGHTS: (classes, opts.gmm_components),
             P.GMM_MEANS: (classes, opts.gmm_components, arch.latent_dim),
             P.GMM_VARIANCES: (classes, opts.gmm_components, arch.latent_dim)}
    floats = {P.EMBEDDINGS, P.GMM_WEIGHTS, P.GMM_MEANS, P.GMM_VARIANCES}
    shapes = P.expected_shapes(opts, k, arch.cond_shape, arch.latent_dim)
    return arrays({name: torch.zeros(sizes[name], dtype=torch.float32 if name in floats else torch.int64)
                   for name in shapes})


def espresso(comm: Comm, cfg, facts, modules: dict, arch) -> None:
    """query.prior (the digest; the weights only to nodes lacking the built-in prior), train (the upload),
    evaluate (the classifier down). Every message carries the run config with the pinned switches."""
    from flwr.app import ConfigRecord

    from fedapp import registry
    from fedapp.models.prior import is_tiny
    from fedapp.protocols import espresso as P

    opts = espresso_options(cfg)
    fixed = getattr(registry.strategy_class(cfg.method), "FIXED", {})
    pinned = {f"espresso.{k.replace('_', '-')}": v for k, v in {**fixed, "gamma1": opts.gamma1}.items()}
    ships = P.needs_prior(opts) and opts.ship_prior != "never" and is_tiny(cfg.prior)
    digest = {P.PRIOR_DIGEST_KEY: ConfigRecord({P.SHA256: "0" * 64})} if ships else {}
    if ships:
        comm.exchange(P.PRIOR, digest, {}, 1, config=pinned, reads_shard=False)
        comm.conditional["prior weights, to each node lacking the built-in prior"] = shipped_prior_bytes(cfg)
    uploads = [espresso_upload_bytes(opts, arch, c) for c in facts.class_counts]
    comm.exchange(P.TRAIN, digest, {}, 1, config=pinned, up_by_client=uploads)
    n = facts.num_clients
    oneshot_evaluate(comm, cfg, modules, pinned, share=P.evaluation_size(opts, n, cfg.min_clients) / n)


def shipped_prior_bytes(cfg) -> int:
    from fedapp.models.prior import prior_folder, prior_to_records
    from fedapp.plan.comm import nbytes

    try:
        weights, files = prior_to_records(prior_folder(cfg.prior, cfg.dataset))
    except (OSError, ValueError):  # not built yet: its size is unknown until it is
        return 0
    return nbytes(weights) + nbytes(files)


def _images(n: int, facts, with_private: bool = False) -> int:
    """Bytes of PFDM's image arrays: n float32 images of the run's shape, their int64 labels (and the
    private-only images)."""
    import torch

    from fedapp.protocols import pfdm as P

    x = torch.zeros(n, facts.channels, facts.image_size, facts.image_size)
    return arrays({P.X: x, P.Y: torch.zeros(n, dtype=torch.int64), **({P.PRIVATE_ONLY: x} if with_private else {})})


def pfdm_family(comm: Comm, cfg, facts, modules: dict) -> None:
    """pfdm: the release up, the shared denoiser down and samples up; local-only: samples up;
    fedavg-ddpm, dpdm: the DDPM down and up each round (no evaluate round); centralized-ddpm: nothing."""
    from fedapp.protocols import ROUND_KEY
    from fedapp.protocols import pfdm as P

    o, m = cfg.options, cfg.method
    if m == "pfdm":
        comm.exchange(P.TRAIN, {}, {}, 1, up_by_client=[_images(n, facts) for n in facts.n_train])
        comm.exchange(P.SAMPLE, {"shared": state_bytes(modules["ddpm.shared"])},
                      {"samples": _images(o.samples, facts, with_private=True)}, 1)
    elif m == "local-only":
        comm.exchange(P.LOCAL_SAMPLE, {}, {"samples": _images(o.samples, facts)}, 1)
    elif m in ("fedavg-ddpm", "dpdm"):
        model = packed_bytes(modules["ddpm"])  # packed as FedAvg's (clients.classify.train_reply)
        phase = P.DPDM_TRAIN if m == "dpdm" else P.FEDAVG_TRAIN
        comm.exchange(phase, {"model": model}, {"model": model}, cfg.num_server_rounds * _shares(cfg, facts)[0],
                      config={ROUND_KEY: 0})


def dcfm_family(comm: Comm, cfg, facts, modules: dict) -> None:
    """Stage I (expert + pair counts up); DCFM-A's allgather rounds (N - 1 peers down, the expert up);
    DCFM-B's student down; DDM's peers + router down; FedFlow's rounds (the global model down and up)."""
    import torch

    from fedapp.protocols import ROUND_KEY
    from fedapp.protocols import dcfm as P

    o, m, n = cfg.options, cfg.method, facts.num_clients
    expert = state_bytes(modules["velocity"])
    sizes = [facts.attribute_sizes.get(a, 1) for a in P.ATTRS]
    counts = arrays({P.PAIRS: torch.zeros(*sizes, dtype=torch.int64)})
    phase = P.phase_record(o.lambda_ci if m == "dcfm" else 0.0)
    if m == "fedflow":
        comm.exchange(P.TRAIN, {"model": expert, "phase": P.phase_record(0.0, steps=o.fl_local_steps)},
                      {"expert": expert, "counts": counts}, cfg.num_server_rounds * _shares(cfg, facts)[0],
                      config={ROUND_KEY: 0})
        return
    comm.exchange(P.TRAIN, {"phase": phase}, {"expert": expert, "counts": counts}, 1)
    if m == "dcfm" and o.variant == "a":
        comm.exchange(P.PEER, {"peers": (n - 1) * (expert + counts)}, {"expert": expert, "counts": counts}, o.rounds,
                      config={ROUND_KEY: 0})
    elif m == "dcfm":
        comm.exchange(P.RECEIVE, {"student": expert}, {}, 1, reads_shard=False)
    elif m == "ddm":
        router = arrays(ddm_router(facts, n).state_dict())
        comm.exchange(P.RECEIVE, {"peers": (n - 1) * expert, "router": router}, {}, 1, reads_shard=False)


def ddm_router(facts, experts: int):
    """DDM's router (the strategy's own class, loaded by name as fedapp.registry loads it)."""
    from fedapp.plan.counts import strategy_module

    return strategy_module("ddm").Router(facts.channels, experts)
