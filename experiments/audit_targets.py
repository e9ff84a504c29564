"""What the privacy audit attacks in a finished run, per kind of method, and the controls built to leak
(docs/privacy.md). Each function turns what an attacker holds into membership scores or generated images; the
scores, figures and distances themselves are fedapp/audit/.

Per client k: members are its training images, non-members its own held-out test images (the same
distribution: the same domain or label mix), equally many of each (a seeded draw). Two attackers:

- `upload`: holds what client k sent (kept by the run: log.uploads, fedapp/server/uploads.py) and the message it
  answered. A model upload (FedAvg family) is scored by its loss and by an offline likelihood ratio against
  shadow uploads: the global model it started from, trained with the client's local recipe on public images of
  the client's class mix (and domain) that are not candidates. A generative upload is turned into images (Espresso
  family: the prior's synthesis from it; PFDM: its releases denoised by a denoiser trained on public data; DCFM: its
  expert sampled at the client's pairs) and a candidate scored by its distance to the nearest of them.
- `global`: holds the run's final model (model.safetensors): a classifier scored by its loss; PFDM's shared
  denoiser by its loss on a fresh release of the candidate; DCFM's student sampled as an expert is.

The shards are re-derived from the run config on the auditor's side (fedapp.data.all_client_shards): an
evaluation oracle, the ground truth of who is a member.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedapp.audit.scores import classifier_loss_scores, lira_offline, logit_confidence, loss_scores, nearest_scores

READER = {"epochs": 8, "width": 16}  # the feature space: GenerationEval's reader recipe, so their caches are shared
# method -> the kind of upload it sends (what the upload attacker turns into scores)
KINDS = {"fedavg": "model", "fedprox": "model", "moon": "model", "feddifrc": "model",
         "espresso": "synthesis", "prompts": "synthesis", "class-embed": "synthesis",
         "centralized": "none", "pfdm": "release", "dcfm": "experts"}
UPLOAD_PHASE = "train"  # every audited method's client upload (DCFM-B: its Stage I expert)


@dataclass(frozen=True)
class RunView:
    """A finished run as the auditor reads it: its folder, flat and parsed config and client count."""

    run_dir: Path
    flat: dict[str, Any]
    cfg: Any
    clients: int

    @classmethod
    def load(cls, run_dir: str | Path) -> RunView:
        from fedapp.config import parse_run_config

        run_dir = Path(run_dir)
        flat = json.loads((run_dir / "config.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
        if summary.get("status") != "completed":
            raise ValueError(f"run {run_dir}: status {summary.get('status')!r}; the audit reads completed runs only")
        return cls(run_dir, flat, parse_run_config(flat), int(summary["num_clients"]))

    @property
    def method(self) -> str:
        return self.cfg.method

    def strategy(self):
        """The run's strategy object (not run): what builds its models and holds its method's settings."""
        from fedapp import registry
        from fedapp.results import RunDir
        from fedapp.server import ServerRun

        run = ServerRun(cfg=self.cfg, out=RunDir(self.run_dir), num_partitions=self.clients, device=self.device)
        return registry.strategy_class(self.method)(run)

    @property
    def device(self) -> str:
        return self.cfg.torch_device()

    def server(self):
        from fedapp.data import server_data

        return server_data(self.cfg, self.clients)

    def final_state(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        from fedapp.server.checkpoint import FINAL_MODEL

        return load_file(str(self.run_dir / FINAL_MODEL))

    def uploads(self) -> dict:
        from fedapp.server.uploads import load_uploads

        kept = load_uploads(self.run_dir, UPLOAD_PHASE)
        if not kept and KINDS[self.method] != "none":
            raise ValueError(f"run {self.run_dir}: no kept uploads; run it with log.uploads=true")
        return kept


# ---- candidates and the feature space -----------------------------------------------------------------------
def candidates(view: RunView, cap: int, seed: int) -> dict[int, tuple[Any, Any]]:
    """partition id -> (members, non-members): equally many of the client's training and held-out test images
    (at most `cap` each), a seeded draw. EVALUATION ORACLE: the shards re-derived from the config."""
    from fedapp.data import all_client_shards

    g = torch.Generator().manual_seed(seed)
    out = {}
    for pid, shard in enumerate(all_client_shards(view.cfg, view.clients)):
        n = min(len(shard.train), len(shard.test), cap)
        if n:
            out[pid] = (shard.train.subset(torch.randperm(len(shard.train), generator=g)[:n]),
                        shard.test.subset(torch.randperm(len(shard.test), generator=g)[:n]))
    return out


@functools.lru_cache(maxsize=4)
def _reader(dataset: str, size: int, seed: int, flat_items: tuple, clients: int):
    from fedapp.config import parse_run_config
    from fedapp.data import server_data
    from fedapp.readers import server_reader

    return server_reader(server_data(parse_run_config(dict(flat_items)), clients), seed, **READER)


def features(view: RunView, x: torch.Tensor) -> torch.Tensor:
    """A reader's penultimate features of x (fedapp.readers: a SmallCNN trained on the dataset's real images
    outside its test split, GenerationEval's recipe): the space every nearest-neighbour distance is taken in."""
    from fedapp.models.classifier import embed_all

    r = _reader(view.cfg.dataset, view.cfg.image_size, view.cfg.seed, tuple(sorted(view.flat.items())), view.clients)
    return embed_all(r.model, x.float()).double()


def reader_accuracy(view: RunView) -> float:
    return _reader(view.cfg.dataset, view.cfg.image_size, view.cfg.seed, tuple(sorted(view.flat.items())),
                   view.clients).held_out_accuracy


# ---- model uploads: loss and the offline likelihood ratio ---------------------------------------------------
def new_classifier(view: RunView) -> torch.nn.Module:
    """The run's classifier, untrained: the round-based strategy's global model (with MOON's or FedDifRC's
    projection head), or the one-shot methods' global classifier (strategies/oneshot.py builds `model` so)."""
    from fedapp.models.classifier import build_classifier

    strat = view.strategy()
    if hasattr(strat, "build_model"):
        return strat.build_model()
    return build_classifier(view.cfg.model, view.server().info.num_classes)


def load_model(view: RunView, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = new_classifier(view)
    model.load_state_dict(state)
    return model.to(view.device).eval()


def kept_weights(view: RunView, arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A kept FedAvg-family weights record ({name: tensor}: the packed vector, fedapp.protocols.weights) as the
    run's classifier's state_dict; a record that holds one array per tensor is that state_dict already."""
    from fedapp.protocols.weights import WEIGHTS, flat_of, unpack

    if WEIGHTS not in arrays:
        return dict(arrays)  # load_model's strict load names any key that does not fit
    return unpack(flat_of(arrays), new_classifier(view).state_dict())


def shadow_set(public: Any, like: Any, g: torch.Generator) -> Any:
    """Public images with the class counts of `like` (a client's training split), of its value of every
    attribute it holds one value of (its domain): a draw of the client's distribution that no candidate is in."""
    pool = torch.ones(len(public), dtype=torch.bool)
    for name, values in like.attrs.items():
        if name in public.attrs and len(values.unique()) == 1:
            pool &= public.attrs[name] == values[0]
    picks = []
    for c, count in enumerate(torch.bincount(like.y.long()).tolist()):
        rows = torch.nonzero(pool & (public.y == c)).flatten()
        if count and len(rows):
            picks.append(rows[torch.randint(len(rows), (count,), generator=g)] if len(rows) < count
                         else rows[torch.randperm(len(rows), generator=g)[:count]])
    return public.subset(torch.cat(picks))


def shadow_confidences(view: RunView, start: dict[str, torch.Tensor], like: Any, cands: torch.Tensor,
                       labels: torch.Tensor, shadows: int, seed: int, epochs: int | None = None) -> np.ndarray:
    """(shadows, N) logit confidences on the candidates of models trained like the client's upload (from
    `start`, the client's local recipe: clients.classify.local_train, `epochs` or the run's local-epochs) on
    shadow sets of public images: models that trained on no candidate."""
    from clients.classify import local_train

    cfg, public = view.cfg, view.server().public
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(shadows):
        data = shadow_set(public, like, g)
        model = new_classifier(view)
        model.load_state_dict(start)
        local_train(model, data.x, data.y, epochs=epochs or cfg.local_epochs, lr=cfg.lr, batch=cfg.batch_size,
                    seed=seed + s, device=view.device)
        out.append(logit_confidence(model, cands, labels))
    return np.stack(out)


def model_upload_scores(view: RunView, up: Any, members: Any, nonmembers: Any, shadows: int,
                        seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """attack -> (member scores, non-member scores) on one client's model upload: loss, and the offline
    likelihood ratio against `shadows` shadow uploads (0: loss only)."""
    from fedapp.protocols import ARRAYS_KEY

    model = load_model(view, kept_weights(view, up.up[ARRAYS_KEY]))
    out = {"loss": (classifier_loss_scores(model, members.x, members.y),
                    classifier_loss_scores(model, nonmembers.x, nonmembers.y))}
    if shadows and ARRAYS_KEY in up.down:
        start = kept_weights(view, up.down[ARRAYS_KEY])
        out["lira"] = lira_scores(view, model, start, all_shards(view)[up.partition].train, members,
                                  nonmembers, shadows, seed)
    return out


def lira_scores(view: RunView, model: torch.nn.Module, start: dict[str, torch.Tensor], like: Any, members: Any,
                nonmembers: Any, shadows: int, seed: int, epochs: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(member, non-member) offline likelihood-ratio scores of `model` against shadow models trained from
    `start` on public draws of `like`'s distribution (shadow_confidences)."""
    x, y = torch.cat([members.x, nonmembers.x]), torch.cat([members.y, nonmembers.y])
    conf = shadow_confidences(view, start, like, x, y, shadows, seed, epochs)
    s = lira_offline(logit_confidence(model, x, y), conf)
    return s[:len(members)], s[len(members):]


def all_shards(view: RunView) -> list:
    from fedapp.data import all_client_shards

    return all_client_shards(view.cfg, view.clients)  # EVALUATION ORACLE


def global_classifier_scores(view: RunView, members: Any, nonmembers: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    model = load_model(view, view.final_state())
    return {"loss": (classifier_loss_scores(model, members.x, members.y),
                     classifier_loss_scores(model, nonmembers.x, nonmembers.y))}


# ---- generative uploads: images from what the client sent ------------------------------------------------
def synthesis_images(view: RunView, pid: int, up: Any) -> torch.Tensor:
    """The prior's synthesis from client `pid`'s Espresso-family upload: the run's own (espresso.save-synthetic,
    the server's synthesis from that upload with the run's seed) when kept, else generated again from it."""
    from safetensors.torch import load_file

    from fedapp.protocols import espresso as E

    kept = view.run_dir / E.SYNTHETIC_FILE
    if kept.is_file():
        syn = load_file(str(kept))
        return syn["x"][syn["client"] == pid]
    return _synthesise(view, pid, up)


def _synthesise(view: RunView, pid: int, up: Any) -> torch.Tensor:
    from fedapp.models.prior import load_or_build_prior
    from fedapp.models.text import class_prompts
    from fedapp.protocols import espresso as E
    from fedapp.seeds import derive_seed
    from strategies.espresso import synthesize_client

    strat, info = view.strategy(), view.server().info
    prior = load_or_build_prior(view.cfg.prior, view.cfg.dataset, view.device)
    prompt_cond = prior.encode_prompts(class_prompts(view.cfg.dataset, info.class_names)).float().cpu()
    x, _, _ = synthesize_client(prior, up.up[E.UPLOAD_KEY], strat.opts, prompt_cond, derive_seed(view.cfg.seed, pid))
    return x


def pfdm_t0(view: RunView) -> int:
    from fedapp.privacy import resolve_t0

    o = view.cfg.options
    return resolve_t0(o.t0, o.epsilon, o.clip, o.delta, o.accountant)


@functools.lru_cache(maxsize=2)
def _pfdm_attacker(run_dir: str):
    from strategies.pfdm_attacks import public_attacker

    view = RunView.load(run_dir)
    server = view.server()
    return public_attacker(view.cfg, pfdm_t0(view), server.public, server.info.num_classes, view.device)


def release_images(view: RunView, pid: int, up: Any, seed: int) -> torch.Tensor:
    """Client `pid`'s PFDM releases denoised t0 -> 0 by the server's public-data denoiser
    (strategies/pfdm_attacks.py: public_attacker, invert): the attacker's guesses of its images."""
    from fedapp.protocols import pfdm as P
    from strategies.pfdm_attacks import invert

    rel = up.up[P.UPLOAD_KEY]
    g = torch.Generator().manual_seed(seed)
    attacker = _pfdm_attacker(str(view.run_dir))
    return invert(attacker, rel[P.X], rel[P.Y], pfdm_t0(view), view.cfg.options.sample_steps, g)


def pfdm_global_scores(view: RunView, members: Any, nonmembers: Any, seed: int) -> dict[str, tuple]:
    """Loss attack on the shared denoiser z_w: its own training loss on a fresh release of each candidate
    (clipped and diffused to t0 as a client releases it), at the levels z_w trains on."""
    from fedapp.models.ddpm import build_ddpm, shared_objective
    from fedapp.privacy import privatize

    o, t0 = view.cfg.options, pfdm_t0(view)
    shared = build_ddpm(view.cfg.image_size, view.server().info.num_classes, flag=False, channels=o.channels)
    shared.load_state_dict(view.final_state())
    t_range, source_t = shared_objective(o.shared, t0, shared.T)
    g = torch.Generator().manual_seed(seed)
    rel = [privatize(c.x, o.clip, t0, g) for c in (members, nonmembers)]
    return {"loss": tuple(loss_scores(shared, r, c.y, t_range, seed + i, source_t=source_t)
                          for i, (r, c) in enumerate(zip(rel, (members, nonmembers))))}


def flow_images(view: RunView, state: dict[str, torch.Tensor], like: Any, seed: int) -> torch.Tensor:
    """A DCFM velocity net (a client's expert or the student) sampled at the (digit, colour) labels of `like`,
    as many images as it has."""
    from fedapp.models.compose import attribute_labels, generate, joint_field
    from fedapp.protocols import dcfm as P
    from strategies.flow import FlowTask

    strat = view.strategy()
    task = FlowTask(strat.run, view.server())
    net = task.load(state)
    y = attribute_labels(like, P.ATTRS)
    return generate(joint_field(net, y), (len(y), *task.shape), view.cfg.options.sample_steps, seed,
                    device=view.device).cpu()


def generated_images(view: RunView, pid: int, up: Any, like: Any, seed: int) -> torch.Tensor:
    """What the upload attacker generates from client `pid`'s generative upload."""
    kind = KINDS[view.method]
    if kind == "synthesis":
        return synthesis_images(view, pid, up)
    if kind == "release":
        return release_images(view, pid, up, seed)
    if kind == "experts":
        from fedapp.protocols import dcfm as P

        return flow_images(view, up.up[P.EXPERT_KEY], like, seed)
    raise ValueError(f"method={view.method!r}: its upload ({kind}) generates no images")


def nearest_attack(view: RunView, generated: torch.Tensor, members: Any, nonmembers: Any) -> tuple:
    """(member, non-member) scores: minus each candidate's feature distance to the nearest generated image."""
    gen = features(view, generated)
    return nearest_scores(features(view, members.x), gen), nearest_scores(features(view, nonmembers.x), gen)


# ---- the control built to leak ------------------------------------------------------------------------------
def overfit_model(view: RunView, train: Any, epochs: int, seed: int) -> tuple[torch.nn.Module, dict]:
    """The positive control: the run's classifier trained from scratch on one client's few training images
    for `epochs` local epochs (the client's recipe, clients.classify.local_train), as if it uploaded that; and
    the initial weights it started from (its shadows start there too)."""
    from clients.classify import local_train

    torch.manual_seed(seed)
    model = new_classifier(view)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    local_train(model, train.x, train.y, epochs=epochs, lr=view.cfg.lr, batch=view.cfg.batch_size, seed=seed,
                device=view.device)
    return model.eval(), start
