"""Espresso (CVPR 2026): one-shot FL; the server synthesises each client's data with a frozen
diffusion prior guided by the clients' fine-grained conditions, GMM noise and Z-sampling.

One round (clients/espresso.py has the client side):
1. `train`: every client uploads per-cluster condition embeddings c^j_{k,y}, their cluster sizes,
   a diagonal GMM {w^{T,m}_{k,y}, mu^{T,m}_{k,y}, Sigma^{T,m}_{k,y}} of its forward-diffused latents
   z^T per class, and its class counts. A bad upload (keys, shapes, dtypes, non-finite values,
   inconsistent counts, negative variances) is dropped with a reason; the run goes on.
2. Semantics-Preserving Sampling, for client k and class y: ratio x n_{k,y} images, each from
   z^T ~ p(z^T_{k,y}) (the GMM; `init=gaussian`: N(0, I)), a condition c^j_{k,y} picked with
   probability |D^j_{k,y}| / n_{k,y}, Z-sampling (samplers.py: T_z, gamma1 > gamma2, CFG against
   the empty prompt), decoded: the synthetic set D'_k.
3. The global classifier (config key `model`) is trained on the union of all D'_k (`server-epochs`),
   evaluated on the server's global test set (per domain) and sent to the clients (`evaluate`),
   which report its accuracy on their real test split.

Switches (the paper's ablation): espresso.conditions = prompts | class | cluster (C),
espresso.init = gaussian | gmm (G), espresso.sampler = ddim | zigzag (Z). Registered baselines with
fixed switches: `prompts` (class prompt, Gaussian noise, DDIM) and `class-embed` (one learned
condition per class, FedDEO-like, Gaussian noise, DDIM).

The prior: the server loads it (`prior` key; the built-in `tiny` is built on first use). Clients
that cannot load it get its weights (prior_to_bytes) in the `train` message: always for `tiny`
(the clients need not have built it) and with `espresso.ship-prior=always`, else when they ask.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import Strategy

from fedapp.config import ConfigError, opt
from fedapp.models.samplers import DEFAULT_GAMMA2, DEFAULT_GUIDANCE, DEFAULT_ZIGZAG_T
from strategies.base import (CLIENT_KEY, RUN_KEY, FedappStrategy, ServerRun, check_arrays, keep_valid,
                             make_messages, partition_of, record_nbytes)

log = logging.getLogger("fedapp")

UPLOAD_KEY = "upload"  # the client's ArrayRecord (clients/espresso.py)
PRIOR_KEY = "prior"  # ConfigRecord {"bytes": prior_to_bytes(folder)} shipped to clients
REQUEST_KEY = "prior-request"  # a client's reply when it cannot load the prior


@dataclass(frozen=True)
class EspressoOptions:
    clusters: int = opt(4, low=1, help="J: clusters (conditions) per class; min(J, n) for a class of n images")
    gmm_components: int = opt(4, low=1, help="M: components of each class's diagonal GMM of z^T")
    ratio: float = opt(5.0, low=0.0, low_open=True, help="synthetic images per real image, per client and class")
    conditions: str = opt("cluster", choices=("prompts", "class", "cluster"),
                          help="prompts: class prompt only; class: one learned condition per class; cluster: J per class (C)")
    init: str = opt("gmm", choices=("gaussian", "gmm"), help="z^T from N(0, I) or from the client's GMM (G)")
    sampler: str = opt("zigzag", choices=("ddim", "zigzag"), help="DDIM or Z-sampling (Z)")
    zigzag_t: int = opt(DEFAULT_ZIGZAG_T, low=0, high=1000, help="T_z: zigzag on steps with t > T_z")
    gamma1: float = opt(DEFAULT_GUIDANCE, low=0.0, help="guidance of the denoising steps (CFG vs the empty prompt)")
    gamma2: float = opt(DEFAULT_GAMMA2, low=0.0, help="guidance of Z-sampling's inversion step (< gamma1)")
    steps: int = opt(10, low=1, high=1000, help="DDIM steps of the server's sampler (10: one zigzag above T_z=800)")
    embed_steps: int = opt(100, low=0, help="Adam steps of condition learning per client (all conditions together)")
    embed_lr: float = opt(0.01, low=0.0, low_open=True, help="Adam learning rate of condition learning")
    embed_batch: int = opt(32, low=1, help="minibatch of condition learning")
    mixup_pairs: int = opt(64, low=1, help="MixUp'd latents per class for the GMM")
    mixup_alpha: float = opt(1.0, low=0.0, low_open=True, help="MixUp lambda ~ Beta(alpha, alpha)")
    diffusions_per_latent: int = opt(4, low=1, help="forward diffusions (fresh eps) of each MixUp'd latent")
    features: str = opt("unet", help="clustering features: unet (the prior's DIFT features) or a DINOv2/CLIP id/folder")
    synth_batch: int = opt(64, low=1, help="images per sampler call on the server")
    ship_prior: str = opt("auto", choices=("auto", "always", "never"),
                          help="send the prior's weights to clients: auto = for tiny, or when a client asks")

    def __post_init__(self) -> None:
        if self.sampler == "zigzag" and not self.gamma2 < self.gamma1:
            raise ConfigError(f"espresso.gamma2={self.gamma2!r}: must be < espresso.gamma1={self.gamma1!r} "
                              "(Z-sampling injects semantics through gamma1 - gamma2)")
        if self.mixup_pairs * self.diffusions_per_latent < self.gmm_components:
            raise ConfigError(f"espresso.mixup-pairs={self.mixup_pairs!r}: mixup-pairs x diffusions-per-latent "
                              f"must be >= espresso.gmm-components={self.gmm_components}")


def derive_seed(*parts: Any) -> int:
    """A seed from the run seed and a salt (partition id, phase), stable across processes."""
    return zlib.crc32(",".join(str(p) for p in parts).encode()) & 0x7FFFFFFF


# ---- validation of an upload ---------------------------------------------------------------------
def expected_shapes(opts: EspressoOptions, num_classes: int, cond_shape: tuple[int, int],
                    latent_dim: int) -> dict[str, tuple]:
    exp: dict[str, tuple] = {"class_counts": (num_classes,)}
    if opts.conditions != "prompts":
        exp.update(embeddings=(None, *cond_shape), embedding_class=(None,), cluster_sizes=(None,))
    if opts.init == "gmm":
        m = opts.gmm_components
        exp.update(gmm_class=(None,), gmm_weights=(None, m), gmm_means=(None, m, latent_dim),
                   gmm_variances=(None, m, latent_dim))
    return exp


def upload_tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(a.numpy().copy()) for k, a in record.items()}


def _check_conditions(u: dict[str, torch.Tensor], counts: torch.Tensor, per_class: int) -> str | None:
    cls, sizes = u["embedding_class"], u["cluster_sizes"]
    if not len(u["embeddings"]) == len(cls) == len(sizes):
        return "embeddings, embedding_class and cluster_sizes differ in length"
    if len(cls) and (cls.min() < 0 or cls.max() >= len(counts)):
        return "embedding_class: class index out of range"
    if len(sizes) and sizes.min() < 1:
        return "cluster_sizes: a cluster with no images"
    for c in range(len(counts)):
        sel = cls == c
        k, n = int(sel.sum()), int(counts[c])
        if n == 0 and k:
            return f"class {c}: conditions for a class with no images"
        if n and not 1 <= k <= per_class:
            return f"class {c}: {k} conditions, expected 1..{per_class}"
        if n and int(sizes[sel].sum()) != n:
            return f"class {c}: cluster sizes sum to {int(sizes[sel].sum())}, class count is {n}"
    return None


def _check_gmm(u: dict[str, torch.Tensor], counts: torch.Tensor) -> str | None:
    cls, w, var = u["gmm_class"], u["gmm_weights"], u["gmm_variances"]
    if not len(cls) == len(w) == len(u["gmm_means"]) == len(var):
        return "gmm_* arrays differ in their number of classes"
    if cls.tolist() != torch.nonzero(counts).flatten().tolist():
        return "gmm_class: must list exactly the classes with images, in order"
    if (w < 0).any() or ((w.sum(1) - 1).abs() > 1e-3).any():
        return "gmm_weights: negative or not summing to 1"
    if (var <= 0).any():
        return "gmm_variances: not positive"
    return None


def validate_upload(content: RecordDict, *, opts: EspressoOptions, num_classes: int,
                    cond_shape: tuple[int, int], latent_dim: int, max_bytes: float | None = None) -> str | None:
    """Why an Espresso upload is unacceptable, or None: check_arrays (keys, shapes, numeric dtype,
    finite, size), then integer counts, conditions consistent with the class counts (1..J per class
    with images, cluster sizes summing to the count), GMM weights on the simplex, variances > 0."""
    rec = content.array_records.get(UPLOAD_KEY)
    why = check_arrays(rec, expected_shapes(opts, num_classes, cond_shape, latent_dim), max_bytes)
    if why is not None:
        return why
    u = upload_tensors(rec)
    for k in ("class_counts", "embedding_class", "cluster_sizes", "gmm_class"):
        if k in u and (u[k].is_floating_point() or u[k].is_complex()):
            return f"{k}: dtype {u[k].dtype} is not an integer type"
    counts = u["class_counts"]
    if counts.min() < 0 or counts.sum() == 0:
        return "class_counts: negative or all zero"
    if opts.conditions != "prompts":
        why = _check_conditions(u, counts, opts.clusters if opts.conditions == "cluster" else 1)
    if why is None and opts.init == "gmm":
        why = _check_gmm(u, counts)
    return why


# ---- Semantics-Preserving Sampling ----------------------------------------------------------------
def sample_gmm(weights: torch.Tensor, means: torch.Tensor, variances: torch.Tensor, n: int,
               gen: torch.Generator) -> torch.Tensor:
    """n draws z^T ~ sum_m w^m N(mu^m, diag(Sigma^m)): pick a component, then mean + std * eps."""
    comp = torch.multinomial(weights.double(), n, replacement=True, generator=gen)
    eps = torch.randn(n, means.shape[1], generator=gen)
    return means[comp] + variances[comp].sqrt() * eps


def plan_synthesis(u: dict[str, torch.Tensor], opts: EspressoOptions, prompt_cond: torch.Tensor,
                   latent_shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(labels (N,), z^T (N, *latent_shape), conditions (N, L, D)) for one client: ratio x n_{k,y}
    images per class. Conditions and noise come from two generators, so switching init or sampler
    leaves the picked conditions unchanged (a controlled ablation)."""
    g_cond, g_noise = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    counts = u["class_counts"]
    labels, noise, cond = [], [], []
    for c in torch.nonzero(counts).flatten().tolist():
        n = max(1, round(opts.ratio * int(counts[c])))
        labels.append(torch.full((n,), c, dtype=torch.long))
        if opts.conditions == "prompts":
            cond.append(prompt_cond[c].expand(n, -1, -1))
        else:  # c^j_{k,y} with probability |D^j_{k,y}| / n_{k,y}
            sel = torch.nonzero(u["embedding_class"] == c).flatten()
            pick = sel[torch.multinomial(u["cluster_sizes"][sel].double(), n, replacement=True, generator=g_cond)]
            cond.append(u["embeddings"][pick])
        if opts.init == "gmm":
            i = int(torch.nonzero(u["gmm_class"] == c)[0])
            z = sample_gmm(u["gmm_weights"][i], u["gmm_means"][i], u["gmm_variances"][i], n, g_noise)
            noise.append(z.view(n, *latent_shape).float())
        else:
            noise.append(torch.randn(n, *latent_shape, generator=g_noise))
    return torch.cat(labels), torch.cat(noise), torch.cat(cond).float()


@torch.no_grad()
def denoise(prior, noise: torch.Tensor, cond: torch.Tensor, opts: EspressoOptions) -> tuple[torch.Tensor, int]:
    """z^T -> images with DDIM or Z-sampling (gamma1, gamma2, T_z), CFG against the empty prompt;
    returns (images (N, 3, H, W) in [-1, 1] on the CPU, UNet evaluations per image)."""
    images, evals = [], 0
    for s in range(0, len(noise), opts.synth_batch):
        out = prior.sample(noise[s:s + opts.synth_batch], cond[s:s + opts.synth_batch], num_steps=opts.steps,
                           guidance=opts.gamma1, sampler=opts.sampler, zigzag_t=opts.zigzag_t, gamma2=opts.gamma2)
        images.append(out.images.float().cpu())
        evals = out.unet_evals
    return torch.cat(images), evals


def synthesize_client(prior, u: dict[str, torch.Tensor], opts: EspressoOptions, prompt_cond: torch.Tensor,
                      seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """D'_k: (images, labels, UNet evaluations per image) from client k's validated upload."""
    labels, noise, cond = plan_synthesis(u, opts, prompt_cond, prior.latent_shape, seed)
    images, evals = denoise(prior, noise, cond, opts)
    return images, labels, evals


# ---- the global classifier --------------------------------------------------------------------------
def train_global_classifier(model: str, x: torch.Tensor, y: torch.Tensor, num_classes: int, *, epochs: int,
                            seed: int, device: str = "cpu") -> torch.nn.Module:
    """min_omega sum_k p_k E_{D'_k} L(omega): one classifier on the union of the synthetic sets
    (AdamW, cosine schedule; fedapp.models.classifier.train_classifier)."""
    from fedapp.models.classifier import build_classifier, train_classifier

    torch.manual_seed(seed)
    net = build_classifier(model, num_classes).to(device)
    return train_classifier(net, x, y, epochs=epochs, seed=seed)


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def synthetic_grid(x: torch.Tensor, y: torch.Tensor, num_classes: int, cols: int = 8) -> torch.Tensor:
    """(num_classes * cols, 3, H, W): the first `cols` images of each class, black where there are fewer."""
    tiles = torch.full((num_classes, cols, *x.shape[1:]), -1.0)
    for c in range(num_classes):
        xc = x[y == c][:cols]
        tiles[c, :len(xc)] = xc
    return tiles.flatten(0, 1)


# ---- the prior on the server ----------------------------------------------------------------------
def prior_folder(spec: str, dataset: str) -> Path | None:
    """The local folder the prior loads from (so its weights can be shipped), None for a hub id."""
    if spec == "tiny" or spec.startswith("tiny:"):
        from fedapp.models.prior import DEFAULT_TINY_DATASET
        from fedapp.models.tiny_prior import tiny_prior_path

        return tiny_prior_path(spec.partition(":")[2] or dataset or DEFAULT_TINY_DATASET)
    path = Path(spec).expanduser()
    return path if path.is_dir() else None


def load_server_prior(spec: str, dataset: str, device: str):
    """load_prior; the built-in tiny prior is built (once, cached) when missing."""
    from fedapp.models import load_prior

    tiny = spec == "tiny" or spec.startswith("tiny:")
    if tiny and not (prior_folder(spec, dataset) / "prior_meta.json").is_file():
        log.info("building the tiny prior for %s (once; cached for later runs)", dataset)
    return load_prior(spec, device=device, dataset=dataset, build=tiny)


# ---- strategies ------------------------------------------------------------------------------------
class OneShotStrategy(FedappStrategy, Strategy):
    """A one-shot method: an upload phase (`execute` decides what) and one evaluation phase in which
    the clients test the server's classifier on their real test split."""

    def __init__(self, run: ServerRun):
        self.bind(run)
        self.client_accuracy: dict[int, dict[str, Any]] = {}

    # Flower hooks (one round) ---------------------------------------------------------------------------
    def configure_train(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []

    def aggregate_train(self, server_round, replies):
        return None, None

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid) -> Iterable[Message]:
        return make_messages(grid, sorted(grid.get_node_ids()), "evaluate",
                             lambda n: RecordDict({"arrays": arrays, RUN_KEY: config}))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        for r in replies:
            if r.has_error():
                continue
            who = r.content.config_records.get(CLIENT_KEY, {})
            m = r.content.metric_records["metrics"]
            self.client_accuracy[int(who.get("partition-id", -1))] = {
                "accuracy": float(m["accuracy"]), "n": int(m["num-examples"]), "domain": who.get("domain")}
        n = sum(v["n"] for v in self.client_accuracy.values())
        acc = sum(v["accuracy"] * v["n"] for v in self.client_accuracy.values()) / max(n, 1)
        return MetricRecord({"client_accuracy": acc})

    def summary(self) -> None:
        log.info("per-client test accuracy: %s", {k: round(v["accuracy"], 4) for k, v in self.client_accuracy.items()})

    # fedapp -----------------------------------------------------------------------------------------------
    def evaluate_classifier(self, grid, model: torch.nn.Module, server) -> dict[str, Any]:
        """Global test accuracy (per domain) on the server, and each client's on its real test split."""
        from fedapp.metrics import accuracy_by_group

        model = model.cpu().eval()
        metrics = accuracy_by_group(model, server.test, server.info, device="cpu")
        msgs = self.configure_evaluate(1, ArrayRecord(model.state_dict()), self.run_config_record(), grid)
        replies = grid.send_and_receive(msgs, timeout=self.run.cfg.round_timeout)
        agg = self.aggregate_evaluate(1, replies)
        self.summary()
        metrics["client_accuracy"] = float(agg["client_accuracy"])
        metrics["per_client_accuracy"] = {str(k): v["accuracy"] for k, v in sorted(self.client_accuracy.items())}
        metrics["client_domain"] = {str(k): v["domain"] for k, v in sorted(self.client_accuracy.items())
                                    if v["domain"] is not None}
        metrics["classifier_bytes"] = parameter_bytes(model)
        metrics["model"] = self.run.cfg.model
        log.info("global test accuracy %.4f %s", metrics["accuracy"], metrics.get("domain_accuracy", ""))
        return metrics

    def server_data(self, num_partitions: int):
        from feddata import load_server_data

        cfg = self.run.cfg
        return load_server_data(cfg.dataset, cfg.partitioner, cfg.partitioner_params, cfg.seed,
                                num_partitions, image_size=cfg.image_size)


class EspressoStrategy(OneShotStrategy):
    FIXED: dict[str, Any] = {}  # switches a registered baseline pins (prompts, class-embed)

    def __init__(self, run: ServerRun):
        super().__init__(run)
        self.opts: EspressoOptions = dataclasses.replace(run.cfg.options, **self.FIXED)
        self.uploads: dict[int, dict[str, torch.Tensor]] = {}  # partition id -> validated upload
        self.upload_bytes: dict[int, int] = {}
        self.domains: dict[int, str] = {}  # partition id -> domain, when the data has domains
        self.client_seconds: dict[int, float] = {}  # partition id -> seconds of its client work
        self.prior = None
        self._prior_bytes: bytes | None = None
        self._check: dict[str, Any] = {}

    def run_config_record(self, **extra: Any) -> ConfigRecord:
        """The run config with the pinned switches, so the clients learn what the method needs."""
        fixed = {f"espresso.{k.replace('_', '-')}": v for k, v in self.FIXED.items()}
        return super().run_config_record(**fixed, **extra)

    # Flower hooks -------------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid,
                        nodes: list[int] | None = None, ship: bool = False) -> Iterable[Message]:
        def content(_node: int) -> RecordDict:
            rd = RecordDict({RUN_KEY: config})
            if ship:
                rd[PRIOR_KEY] = ConfigRecord({"bytes": self.prior_bytes()})
            return rd

        return make_messages(grid, sorted(grid.get_node_ids()) if nodes is None else nodes, "train", content)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        """Keep the valid uploads (bad ones are dropped with a reason); nothing is averaged."""
        cfg = self.run.cfg
        kept = keep_valid(self.run, replies, "train", lambda c: validate_upload(c, **self._check))
        for r in kept:
            pid = partition_of(r)
            pid = pid if pid is not None else r.metadata.src_node_id
            self.uploads[pid] = upload_tensors(r.content.array_records[UPLOAD_KEY])
            self.upload_bytes[pid] = record_nbytes(RecordDict({UPLOAD_KEY: r.content.array_records[UPLOAD_KEY]}))
            m = r.content.metric_records.get("metrics")
            if m is not None and "client-seconds" in m:
                self.client_seconds[pid] = round(float(m["client-seconds"]), 2)
            domain = r.content.config_records.get(CLIENT_KEY, {}).get("domain")
            if isinstance(domain, str):
                self.domains[pid] = domain
        log.info("[train] kept uploads of clients %s (min-clients=%d); client seconds %s", sorted(self.uploads),
                 cfg.min_clients, self.client_seconds)
        return None, MetricRecord({"num-uploads": len(kept)})

    # fedapp -------------------------------------------------------------------------------------------
    def prior_bytes(self) -> bytes:
        if self._prior_bytes is None:
            from fedapp.models import prior_to_bytes

            folder = prior_folder(self.run.cfg.prior, self.run.cfg.dataset)
            if folder is None:
                raise RuntimeError(f"prior={self.run.cfg.prior!r} is a hub id: the server has no folder to ship; "
                                   "give clients the prior locally or name a folder")
            self._prior_bytes = prior_to_bytes(folder)
        return self._prior_bytes

    def clients_need_prior(self) -> bool:
        """Prompts-only with Gaussian noise: the clients upload class counts only (no prior)."""
        return self.opts.conditions != "prompts" or self.opts.init == "gmm"

    def ship_first(self) -> bool:
        spec = self.run.cfg.prior
        if not self.clients_need_prior():
            return False
        return self.opts.ship_prior == "always" or (
            self.opts.ship_prior == "auto" and (spec == "tiny" or spec.startswith("tiny:")))

    def collect_uploads(self, grid) -> None:
        """The one upload round; clients that ask for the prior get its weights and answer again."""
        cfg = self.run.cfg
        config = self.run_config_record()
        replies = list(grid.send_and_receive(self.configure_train(1, ArrayRecord(), config, grid,
                                                                  ship=self.ship_first()),
                                             timeout=cfg.round_timeout))
        asking = [r for r in replies if not r.has_error() and REQUEST_KEY in r.content.config_records]
        if asking:
            nodes = sorted(r.metadata.src_node_id for r in asking)
            asked = {id(r) for r in asking}
            replies = [r for r in replies if id(r) not in asked]
            try:
                size = len(self.prior_bytes())
            except RuntimeError as err:  # nothing to ship (hub id): those clients are out
                for n in nodes:
                    self.run.fail(n, "train", f"cannot load the prior and it cannot be shipped: {err}")
            else:
                log.info("[train] %d client(s) cannot load the prior: shipping it (%d bytes)", len(nodes), size)
                replies += list(grid.send_and_receive(
                    self.configure_train(1, ArrayRecord(), config, grid, nodes, ship=True), timeout=cfg.round_timeout))
        self.aggregate_train(1, replies)

    def synthesize_all(self, prompt_cond: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The union of D'_k over the valid uploads; saves a grid of each client's synthetic images."""
        from fedapp.models.tiny_prior import sample_grid

        xs, ys, evals = [], [], 0
        for pid, u in sorted(self.uploads.items()):
            t0 = time.time()
            x, y, evals = synthesize_client(self.prior, u, self.opts, prompt_cond, derive_seed(self.run.cfg.seed, pid))
            name = f"synthetic_client{pid}" + (f"_{self.domains[pid]}" if self.domains.get(pid) else "")
            sample_grid(synthetic_grid(x, y, num_classes), num_classes, self.run.out.path("images", f"{name}.png"))
            log.info("[synthesis] client %d: %d images in %.1fs (%d UNet evals/image)", pid, len(x),
                     time.time() - t0, evals)
            xs.append(x)
            ys.append(y)
        return torch.cat(xs), torch.cat(ys), evals

    def execute(self, grid) -> dict[str, Any]:
        from fedapp.models.text import class_prompts

        cfg, run = self.run.cfg, self.run
        nodes = sorted(grid.get_node_ids())
        server = self.server_data(len(nodes))
        t0 = time.time()
        self.prior = load_server_prior(cfg.prior, cfg.dataset, run.device)
        run.phase_seconds["prior"] = time.time() - t0
        self._check = dict(opts=self.opts, num_classes=server.info.num_classes, cond_shape=self.prior.cond_shape,
                           latent_dim=int(torch.tensor(self.prior.latent_shape).prod()),
                           max_bytes=cfg.max_upload_mb * 2**20)
        self.collect_uploads(grid)

        t0 = time.time()
        prompt_cond = self.prior.encode_prompts(class_prompts(cfg.dataset, server.info.class_names)).float().cpu()
        x, y, evals = self.synthesize_all(prompt_cond, server.info.num_classes)
        run.phase_seconds["synthesis"] = time.time() - t0
        t0 = time.time()
        model = train_global_classifier(cfg.model, x, y, server.info.num_classes, epochs=cfg.server_epochs,
                                        seed=cfg.seed, device=run.device)
        run.phase_seconds["classifier"] = time.time() - t0

        metrics = self.evaluate_classifier(grid, model, server)
        metrics.update({
            "upload_bytes_per_client": {str(k): v for k, v in sorted(self.upload_bytes.items())},
            "client_seconds": {str(k): v for k, v in sorted(self.client_seconds.items())},
            "num_synthetic": len(x), "unet_evals_per_image": evals,
            "options": {k.replace("_", "-"): v for k, v in dataclasses.asdict(self.opts).items()},
        })
        run.out.log_metrics({"phase": "final", **metrics})
        return metrics


class PromptsStrategy(EspressoStrategy):
    """Baseline: the class prompt only (no learned condition), N(0, I) noise, DDIM."""

    FIXED = {"conditions": "prompts", "init": "gaussian", "sampler": "ddim"}


class ClassEmbedStrategy(EspressoStrategy):
    """Baseline (FedDEO-like): one learned condition per class, N(0, I) noise, DDIM."""

    FIXED = {"conditions": "class", "init": "gaussian", "sampler": "ddim"}
