"""Espresso (CVPR 2026): one-shot FL; the server synthesises each client's data with a frozen
diffusion prior guided by the clients' fine-grained conditions, GMM noise and Z-sampling.

One round (clients/espresso.py has the client side):
1. `train`: every client uploads per-cluster condition embeddings c^j_{k,y}, their cluster sizes,
   a diagonal GMM {w^{T,m}_{k,y}, mu^{T,m}_{k,y}, Sigma^{T,m}_{k,y}} of its forward-diffused latents
   z^T per class, and its class counts. A bad upload (keys, shapes, dtypes, non-finite values,
   inconsistent counts, negative variances) is dropped with a reason; the run goes on.
2. Semantics-Preserving Sampling, for client k and class y: ratio x n_{k,y} images, each from
   z^T ~ p(z^T_{k,y}) (the GMM; `init=gaussian`: N(0, I)), a condition c^j_{k,y} picked with
   probability |D^j_{k,y}| / n_{k,y}, Z-sampling (fedapp/models/prior/samplers.py: T_z, gamma1 > gamma2, CFG against
   the empty prompt), decoded: the synthetic set D'_k.
3. The global classifier (config key `model`) is trained on the union of all D'_k (`server-epochs`),
   evaluated on the server's global test set (per domain) and sent to the clients (`evaluate`; all, a
   seeded sample or none: espresso.evaluate-clients), which report its accuracy on their real test split.

Switches (the paper's ablation): espresso.conditions = prompts | class | cluster (C),
espresso.init = gaussian | gmm (G), espresso.sampler = ddim | zigzag (Z). Registered baselines with
fixed switches: `prompts` (class prompt, Gaussian noise, DDIM) and `class-embed` (one learned
condition per class, FedDEO-like, Gaussian noise, DDIM).

The prior: the server loads it (`prior` key; the built-in `tiny` is built on first use) and ships the
built-in one to the nodes that lack it in `query.prior` waves before training (asked by its digest; an
ArrayRecord of its weights, which Flower chunks); the `train` message only names that digest. A folder or
hub prior every node loads from its own disk or cache.
The message protocol (keys, upload schema, validation) is fedapp/protocols/espresso.py.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ConfigRecord, Message, RecordDict

from fedapp.data import for_classifier
from fedapp.images import save_class_grid
from fedapp.progress import Progress
from fedapp.protocols import CLIENT_KEY, DOMAIN_KEY, METRICS_KEY
from fedapp.protocols import espresso as P
from fedapp.protocols.records import partition_of, record_nbytes, tensors_of
from fedapp.seeds import derive_seed
from fedapp.server import ServerRun, keep_valid
from strategies.oneshot import OneShotStrategy, train_global_classifier

if TYPE_CHECKING:
    from fedapp.models.prior import Prior

log = logging.getLogger("fedapp")


# ---- Semantics-Preserving Sampling ----------------------------------------------------------------
def sample_gmm(weights: torch.Tensor, means: torch.Tensor, variances: torch.Tensor, n: int,
               gen: torch.Generator) -> torch.Tensor:
    """n draws z^T ~ sum_m w^m N(mu^m, diag(Sigma^m)): pick a component, then mean + std * eps."""
    comp = torch.multinomial(weights.double(), n, replacement=True, generator=gen)
    eps = torch.randn(n, means.shape[1], generator=gen)
    return means[comp] + variances[comp].sqrt() * eps


def images_per_class(counts: torch.Tensor, ratio: float) -> dict[int, int]:
    """class y -> ratio x n_{k,y} images (at least one) for every class client k has."""
    return {c: max(1, round(ratio * int(counts[c]))) for c in torch.nonzero(counts).flatten().tolist()}


def plan_synthesis(u: dict[str, torch.Tensor], opts: P.EspressoOptions, prompt_cond: torch.Tensor,
                   latent_shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(labels (N,), z^T (N, *latent_shape), conditions (N, L, D)) for one client: ratio x n_{k,y}
    images per class. Conditions and noise come from two generators, so switching init or sampler
    leaves the picked conditions unchanged (a controlled ablation)."""
    g_cond, g_noise = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    labels, noise, cond = [], [], []
    for c, n in images_per_class(u[P.CLASS_COUNTS], opts.ratio).items():
        labels.append(torch.full((n,), c, dtype=torch.long))
        if opts.conditions == "prompts":
            cond.append(prompt_cond[c].expand(n, -1, -1))
        else:  # c^j_{k,y} with probability |D^j_{k,y}| / n_{k,y}
            sel = torch.nonzero(u[P.EMBEDDING_CLASS] == c).flatten()
            pick = sel[torch.multinomial(u[P.CLUSTER_SIZES][sel].double(), n, replacement=True, generator=g_cond)]
            cond.append(u[P.EMBEDDINGS][pick])
        if opts.init == "gmm":
            i = int(torch.nonzero(u[P.GMM_CLASS] == c)[0])
            z = sample_gmm(u[P.GMM_WEIGHTS][i], u[P.GMM_MEANS][i], u[P.GMM_VARIANCES][i], n, g_noise)
            noise.append(z.view(n, *latent_shape).float())
        else:
            noise.append(torch.randn(n, *latent_shape, generator=g_noise))
    return torch.cat(labels), torch.cat(noise), torch.cat(cond).float()


@torch.no_grad()
def denoise(prior, noise: torch.Tensor, cond: torch.Tensor, opts: P.EspressoOptions,
            progress: Progress | None = None) -> tuple[torch.Tensor, int]:
    """z^T -> images with DDIM or Z-sampling (gamma1, gamma2, T_z, convention), CFG against the empty
    prompt, over `opts.steps` timesteps of `opts.spacing` starting at samplers.start_timestep;
    returns (images (N, 3, H, W) in [-1, 1] on the CPU, UNet evaluations per image). `progress`
    counts the images."""
    images, evals = [], 0
    settings = opts.sampler_settings()
    for s in range(0, len(noise), opts.synth_batch):
        out = prior.sample(noise[s:s + opts.synth_batch], cond[s:s + opts.synth_batch], settings)
        images.append(out.images.float().cpu())
        evals = out.unet_evals
        if progress is not None:
            progress.advance(len(images[-1]))
    return torch.cat(images), evals


def synthesize_client(prior, u: dict[str, torch.Tensor], opts: P.EspressoOptions, prompt_cond: torch.Tensor,
                      seed: int, progress: Progress | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """D'_k: (images, labels, UNet evaluations per image) from client k's validated upload."""
    labels, noise, cond = plan_synthesis(u, opts, prompt_cond, prior.latent_shape, seed)
    images, evals = denoise(prior, noise, cond, opts, progress)
    return images, labels, evals


# ---- the strategy -----------------------------------------------------------------------------------
GRID_CLIENTS = 32  # image grids of the first 32 clients' synthetic sets: at 1,000 clients a grid each took 16 s


class EspressoStrategy(OneShotStrategy):
    """train (one upload per client) -> synthesis -> global classifier -> evaluate."""

    FIXED: dict[str, Any] = {}  # switches a registered baseline pins (prompts, class-embed)
    run: ServerRun[P.EspressoOptions]

    def __init__(self, run: ServerRun[P.EspressoOptions]):
        super().__init__(run)
        opts = dataclasses.replace(run.cfg.options, **self.FIXED)
        self.opts: P.EspressoOptions = dataclasses.replace(opts, gamma1=P.guidance(opts, run.cfg))
        self.uploads: dict[int, dict[str, torch.Tensor]] = {}  # partition id -> validated upload
        self.upload_bytes: dict[int, int] = {}
        self.domains: dict[int, str] = {}  # partition id -> domain, when the data has domains
        self.client_seconds: dict[int, float] = {}  # partition id -> seconds of its client work
        self.prior: Prior | None = None  # loaded by the evaluation phase
        self._prior_records: dict[str, Any] | None = None

    def run_config_record(self, **extra: Any) -> ConfigRecord:
        """The run config with the pinned switches, so the clients learn what the method needs."""
        ns = self.run.cfg.spec.namespace
        fixed = {f"{ns}.{k.replace('_', '-')}": v for k, v in {**self.FIXED, "gamma1": self.opts.gamma1}.items()}
        return super().run_config_record(**fixed, **extra)

    # ---- phase 1: the uploads -----------------------------------------------------------------------
    def prior_records(self) -> dict[str, Any]:
        """The built-in prior as records (Flower chunks the ArrayRecord) and its digest."""
        if self._prior_records is None:
            from fedapp.models.prior import prior_folder, prior_to_records, records_digest

            weights, files = prior_to_records(prior_folder(self.run.cfg.prior, self.run.cfg.dataset))
            self._prior_records = {P.PRIOR_WEIGHTS_KEY: weights, P.PRIOR_FILES_KEY: files,
                                   P.PRIOR_DIGEST_KEY: ConfigRecord({P.SHA256: records_digest(weights, files)})}
        return self._prior_records

    def distribute_prior(self, grid, nodes: list[int]) -> list[int]:
        """The nodes that hold the shipped prior after asking by digest and sending the weights in doubling
        waves to those that lack it (fedapp.server.prior_waves); the others are recorded and left out."""
        from fedapp.server.prior_waves import distribute
        from fedapp.server.validation import passing

        recs = self.prior_records()
        digest_only = {P.PRIOR_DIGEST_KEY: recs[P.PRIOR_DIGEST_KEY]}

        def answers(targets: list[int], records: dict[str, Any]) -> dict[int, bool]:
            replies = self.exchange(grid, P.PRIOR, targets, lambda n: records, config=self.run_config_record())
            kept = passing(self.run, replies, P.PRIOR, P.validate_has_prior)
            return {r.metadata.src_node_id: r.content.metric_records[METRICS_KEY][P.HAS_PRIOR] == 1 for r in kept}

        with self.run.phase("ship-prior", f"ask {len(nodes)} nodes for {recs[P.PRIOR_DIGEST_KEY][P.SHA256][:16]}…"):
            waves = distribute(nodes, lambda t: answers(t, digest_only), lambda t: answers(t, recs),
                               waves=self.opts.ship_prior == "auto")
        for n in waves.refused:
            self.run.fail(n, P.PRIOR.name, "sent the shipped prior, still does not hold it")
        log.info("[prior] %d of %d nodes hold it; weights sent to %d (%d questions in %d rounds)", len(waves.holders),
                 len(nodes), len(waves.sent_to), waves.asked, waves.questions)
        return sorted(waves.holders)

    def ships_prior(self) -> bool:
        """The built-in tiny prior goes to the clients (they need not have built it) unless
        ship-prior=never or the clients need no prior; a folder or hub prior never does."""
        from fedapp.models.prior import is_tiny

        return P.needs_prior(self.opts) and self.opts.ship_prior != "never" and is_tiny(self.run.cfg.prior)

    def collect_uploads(self, grid, nodes: list[int], validate) -> None:
        """The one upload phase: every valid upload is kept."""
        named: dict[str, Any] = {}  # the shipped prior's digest: the train message names what the node holds
        if self.ships_prior():
            nodes = self.distribute_prior(grid, nodes)
            named = {P.PRIOR_DIGEST_KEY: self.prior_records()[P.PRIOR_DIGEST_KEY]}
        replies = self.exchange(grid, P.TRAIN, nodes, lambda n: named, config=self.run_config_record())
        for r in keep_valid(self.run, replies, P.TRAIN, validate):
            self.keep_upload(r)
        secs = sorted(self.client_seconds.values()) or [0.0]  # a summary: one line at any number of clients
        log.info("[train] kept %d uploads (min-clients=%d); client seconds median %.1f, max %.1f", len(self.uploads),
                 self.run.cfg.min_clients, secs[len(secs) // 2], secs[-1])

    def keep_upload(self, reply: Message) -> None:
        pid = partition_of(reply)
        pid = pid if pid is not None else reply.metadata.src_node_id
        rec = reply.content.array_records[P.UPLOAD_KEY]
        self.uploads[pid] = tensors_of(rec)
        self.upload_bytes[pid] = record_nbytes(RecordDict({P.UPLOAD_KEY: rec}))
        m = reply.content.metric_records[METRICS_KEY]
        if P.CLIENT_SECONDS in m:
            self.client_seconds[pid] = round(float(m[P.CLIENT_SECONDS]), 2)
        domain = reply.content.config_records.get(CLIENT_KEY, {}).get(DOMAIN_KEY)
        if isinstance(domain, str):
            self.domains[pid] = domain

    # ---- server work: synthesis --------------------------------------------------------------------
    def num_synthetic(self) -> int:
        """How many images synthesis will make from the valid uploads."""
        return sum(sum(images_per_class(u[P.CLASS_COUNTS], self.opts.ratio).values()) for u in self.uploads.values())

    def synthesize_all(self, prompt_cond: torch.Tensor, num_classes: int, class_names: list[str] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The union of D'_k over the valid uploads (images, labels, client of each image, UNet evals per
        image). Each client's labels, noise and conditions are planned from its own seed (plan_synthesis),
        then denoised together in batches of espresso.synth-batch across clients: at 1,000 clients of one
        or two images each, one sampler call per client cost more than its images. Saves a grid of the
        synthetic images of each of the first GRID_CLIENTS clients, a row per class (labelled with
        class_names when given)."""
        plans = {pid: plan_synthesis(u, self.opts, prompt_cond, self.prior.latent_shape,
                                     derive_seed(self.run.cfg.seed, pid)) for pid, u in sorted(self.uploads.items())}
        y = torch.cat([labels for labels, _, _ in plans.values()])
        who = torch.cat([torch.full((len(labels),), pid, dtype=torch.long) for pid, (labels, _, _) in plans.items()])
        progress = Progress("synthesis", len(y), unit="images", eta=True)
        x, evals = denoise(self.prior, torch.cat([noise for _, noise, _ in plans.values()]),
                           torch.cat([cond for _, _, cond in plans.values()]), self.opts, progress)
        for pid in list(plans)[:GRID_CLIENTS]:
            mine = who == pid
            name = f"synthetic_client{pid}" + (f"_{self.domains[pid]}" if self.domains.get(pid) else "")
            save_class_grid(x[mine], y[mine], num_classes, self.run.out.path("images", f"{name}.png"),
                            class_names=class_names)
        return x, y, who, evals

    def save_synthetic(self, x: torch.Tensor, y: torch.Tensor, who: torch.Tensor) -> None:
        from fedapp.server.checkpoint import save_tensors

        save_tensors(self.run.out, P.SYNTHETIC_FILE, {"x": x, "y": y, "client": who})

    # ---- evaluation -----------------------------------------------------------------------------------
    def evaluation_nodes(self, nodes: list[int]) -> list[int]:
        """The nodes the evaluate phase sends the classifier to (espresso.evaluate-clients, P.evaluation_size):
        every node, or a sample of that many drawn from the run seed (every node at 1,000 clients is 1.6 GB of
        classifiers down), or none."""
        n = P.evaluation_size(self.opts, len(nodes), self.run.cfg.min_clients)
        if n >= len(nodes):
            return nodes
        picked = sorted(random.Random(derive_seed(self.run.cfg.seed, "evaluate-clients")).sample(sorted(nodes), n))
        log.info("evaluate phase: %d of %d clients, a sample drawn from seed %d (espresso.evaluate-clients=%s); "
                 "the summary's evaluated_partitions names them", n, len(nodes), self.run.cfg.seed,
                 self.opts.evaluate_clients)
        return picked

    # ---- the protocol -------------------------------------------------------------------------------
    def execute(self, grid) -> dict[str, Any]:
        from fedapp.models.prior import load_or_build_prior
        from fedapp.models.text import class_prompts

        cfg, run = self.run.cfg, self.run
        nodes = sorted(grid.get_node_ids())
        server = self.server_data(len(nodes))
        with run.phase("prior", f"load {cfg.prior}"):
            self.prior = load_or_build_prior(cfg.prior, cfg.dataset, run.device)
        check = dict(opts=self.opts, num_classes=server.info.num_classes, cond_shape=self.prior.cond_shape,
                     latent_dim=int(torch.tensor(self.prior.latent_shape).prod()), max_bytes=cfg.max_upload_bytes)
        self.collect_uploads(grid, nodes, lambda c: P.validate_upload(c, **check))

        with run.phase("synthesis", f"{self.num_synthetic()} images for {len(self.uploads)} clients"):
            prompt_cond = self.prior.encode_prompts(class_prompts(cfg.dataset, server.info.class_names)).float().cpu()
            x, y, who, evals = self.synthesize_all(prompt_cond, server.info.num_classes, server.info.class_names)
            if self.opts.save_synthetic:
                self.save_synthetic(x, y, who)
        with run.phase("classifier", f"{cfg.server_epochs} epochs on {len(x)} synthetic images"):
            x = for_classifier(x, cfg)  # synthesised at the prior's size, trained on at classifier-size
            model = train_global_classifier(cfg.model, x, y, server.info.num_classes, epochs=cfg.server_epochs,
                                            seed=cfg.seed, device=run.device)

        metrics = self.evaluate_classifier(grid, model, server, self.evaluation_nodes(nodes))
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
