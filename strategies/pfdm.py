"""PFDM (CVPR 2026, "Personalized Federated Training of Diffusion Models with Privacy Guarantees"):
one round; the server trains a shared denoiser z_w only on the clients' local-DP uploads.
Protocol (phases, record keys, upload validation): fedapp/protocols/pfdm.py.

1. `train`: each client trains its private denoiser z_theta_m (kept on the client) and uploads
   D~_m = {(sqrt(abar_t0) CLIP(x, C) + sqrt(1 - abar_t0) z, y)} (clients/pfdm.py, fedapp/privacy.py).
   The server checks keys, shapes, dtypes, finiteness and |x| == |y| (P.validate_upload) and drops a
   bad upload.
2. The server trains z_w on the union of the D~_m: Gaussian noise -> the mixture of the clients' noised
   images. pfdm.shared = relative: levels (t0, T] only (DDPM.loss with source_t = t0: the uploads are
   already x_t0); algorithm2: a standard DDPM over (0, T] whose data are the uploads
   (fedapp.models.ddpm.shared_objective).
3. `query.sample`: z_w goes to every client, which samples shared T -> t0 then private t0 -> 0 and
   returns the samples for scoring (an evaluation step, not part of the protocol).
Evaluation (strategies/generation_eval.py: GenerationEval): Frechet distance on reference-classifier
features per client for its majority/minority classes, and three attacks on what the server holds
(strategies/pfdm_attacks.py): loss-threshold membership inference on z_w, a nearest-neighbour
memorisation check of z_w's own generations, and a reconstruction attempt from the uploads with a
denoiser the server trains on its public data.
summary.json `privacy`: epsilon (Theorem 5.1), delta, t0, clip.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord

from fedapp.models.checkpoints import run_train_state
from fedapp.models.ddpm import DDPM, build_ddpm, shared_objective, shared_sample, split_steps, train_ddpm
from fedapp.privacy import privacy_record, privatize, resolve_t0
from fedapp.protocols import pfdm as P
from fedapp.protocols.records import partition_of, tensors_of
from fedapp.server import PhasedStrategy, ServerRun
from fedapp.server.checkpoint import save_model
from strategies.generation_eval import GenerationEval
from strategies.pfdm_attacks import attacks

log = logging.getLogger("fedapp")


HANDOVER_ENERGY_TOL = 0.05  # z_w's level-t0 samples carry 1.00 +- 0.05 of a real release's energy
HANDOVER_KID_SPREAD = 3.0  # ... and a KID no further above the reference mean than this many of its stds
HANDOVER_REFERENCES = 5  # releases of held-out images whose KIDs give the reference mean and spread


def t0_match_figures(at_t0: torch.Tensor, real: torch.Tensor, held_out: list[torch.Tensor],
                     seed: int = 0) -> dict[str, float]:
    """Does z_w hand over the level-t0 marginal? KID on flattened level-t0 pixels (what the private model
    receives) between its samples and a real release, beside the KIDs of several releases of other held-out
    images against the same one: their mean and std are what an exact z_w scores and its spread.
    t0_energy_ratio: mean squared pixel of the samples over the real release's (1: as much noise + signal).
    t0_handover_ok (1 or 0): the energy within HANDOVER_ENERGY_TOL of the real release's and the KID within
    HANDOVER_KID_SPREAD reference stds above the reference mean."""
    from fedapp.metrics import kernel_distance

    flat = [x.flatten(1).double().numpy() for x in (at_t0, real)]
    kid, kid_std = kernel_distance(flat[0], flat[1], seed=seed)
    refs = np.array([kernel_distance(h.flatten(1).double().numpy(), flat[1], seed=seed)[0] for h in held_out])
    energy = lambda x: float(x.double().pow(2).mean())  # noqa: E731
    ratio = energy(at_t0) / energy(real)
    ref_ratio = np.array([energy(h) / energy(real) for h in held_out])
    ok = abs(ratio - 1) <= HANDOVER_ENERGY_TOL and kid <= refs.mean() + HANDOVER_KID_SPREAD * refs.std()
    return {"t0_kid": kid, "t0_kid_std": kid_std, "t0_kid_reference": float(refs.mean()),
            "t0_kid_reference_std": float(refs.std()), "t0_energy_ratio": ratio,
            "t0_energy_ratio_reference": float(ref_ratio.mean()), "t0_handover_ok": float(ok)}


class PFDMStrategy(PhasedStrategy):
    run: ServerRun[P.PFDMOptions]

    def __init__(self, run: ServerRun[P.PFDMOptions]):
        super().__init__(run)
        o = run.cfg.options
        self.t0 = resolve_t0(o.t0, o.epsilon, o.clip, o.delta, o.accountant)
        self.privacy = privacy_record(self.t0, o.clip, o.delta, o.accountant)

    def train_shared(self, x: torch.Tensor, y: torch.Tensor, num_classes: int) -> DDPM:
        """z_w on the uploads only, with the objective pfdm.shared names (shared_objective)."""
        cfg, o = self.run.cfg, self.run.cfg.options
        torch.manual_seed(cfg.seed)
        shared = build_ddpm(cfg.image_size, num_classes, flag=False, channels=o.channels)
        t_range, source_t = shared_objective(o.shared, self.t0, shared.T)
        loss = train_ddpm(shared, x, y, steps=o.shared_steps, batch=o.batch, lr=o.lr, seed=cfg.seed,
                          t_range=t_range, source_t=source_t, device=self.run.device, ema=o.ema,
                          p_uncond=o.p_uncond, state=run_train_state(cfg, "shared"))
        self.run.out.log_metrics({"phase": "shared", "loss": loss, "num_uploads": len(x)})
        return shared.cpu()

    def execute(self, grid) -> dict[str, Any]:
        cfg, o, run = self.run.cfg, self.run.cfg.options, self.run
        nodes = sorted(grid.get_node_ids())
        log.info("pfdm: t0=%d C=%g -> (epsilon=%.4f, delta=%g)-LDP per data point", self.t0, o.clip,
                 self.privacy["epsilon"], o.delta)
        with run.phase("reference-classifier"):
            ev = GenerationEval(run, len(nodes))
        max_bytes = cfg.max_upload_bytes

        # 1. private training + local-DP uploads
        replies = self.exchange(grid, P.TRAIN, nodes,
                                validate=lambda c: P.validate_upload(c, ev.shape, ev.num_classes, max_bytes))
        uploads = {partition_of(r): tensors_of(r.content.array_records[P.UPLOAD_KEY]) for r in replies}
        x_up, y_up = self.union(uploads)

        # 2. the shared denoiser z_w
        with run.phase("shared-denoiser"):
            shared = self.train_shared(x_up, y_up, ev.num_classes)
            save_model(run.out, shared.state_dict())  # z_w: what the server holds and sends

        # 3. personalised sampling on the clients (evaluation)
        payload = ArrayRecord(shared.state_dict())
        got = self.exchange(grid, P.SAMPLE, [r.metadata.src_node_id for r in replies],
                            lambda n: {P.SHARED_KEY: payload},
                            validate=lambda c: P.validate_samples(c, ev.shape, (P.X, P.Y, P.PRIVATE_ONLY)))
        samples = {partition_of(r): tensors_of(r.content.array_records[P.SAMPLES_KEY]) for r in got}
        with run.phase("evaluation"):
            metrics = ev.per_client({p: (s[P.X], s[P.Y]) for p, s in samples.items()})
            # the non-collaborative reference from the same run: each private model alone, T -> 0
            metrics.update(ev.per_client({p: (s[P.PRIVATE_ONLY], s[P.Y]) for p, s in samples.items()},
                                         prefix="private_only_"))
            for p, s in samples.items():
                ev.save_grid(s[P.X], s[P.Y], f"pfdm_client{p}.png")
                ev.save_grid(s[P.PRIVATE_ONLY], s[P.Y], f"private_only_client{p}.png")
            # attacks on what the server holds (strategies/pfdm_attacks.py)
            metrics.update(attacks(run, self.t0, ev, shared, uploads, (x_up, y_up), len(nodes)))
            metrics.update(self.t0_match(shared, ev))
        metrics.update({"t0": self.t0, "epsilon": self.privacy["epsilon"], "num_uploads": len(x_up),
                        **ev.reader_figures()})
        run.out.log_metrics({"phase": "final", **metrics})
        return metrics

    @staticmethod
    def union(uploads: dict[int, dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every client's D~_m in one (x~, y), in the order the replies came."""
        return (torch.cat([u[P.X].float() for u in uploads.values()]),
                torch.cat([u[P.Y].long() for u in uploads.values()]))

    @torch.no_grad()
    def t0_match(self, shared: DDPM, ev: GenerationEval) -> dict[str, float]:
        """Does z_w hand over what the private models expect? Its samples at level t0 (shared_sample, as the
        clients draw them) against held-out test images clipped and diffused to t0, beside HANDOVER_REFERENCES
        releases of other held-out images (the public split) against the same one: what an exact z_w would
        score (t0_match_figures)."""
        cfg, o = self.run.cfg, self.run.cfg.options
        test, public = ev.server.test, ev.server.public
        n = min(o.attack_samples, len(test), len(public))
        g = torch.Generator().manual_seed(cfg.seed + 11)
        idx = torch.randperm(len(test), generator=g)[:n]
        y = test.y[idx].long()  # the test draw's class mix
        k_shared, _ = split_steps(o.sample_steps, self.t0, shared.T)  # as the clients sample it
        at_t0 = shared_sample(shared, y, self.t0, o.shared, k_shared, g, o.handover, o.clip)
        real = privatize(test.x[idx], o.clip, self.t0, g)
        held_out = [privatize(public.x[torch.randperm(len(public), generator=g)[:n]], o.clip, self.t0, g)
                    for _ in range(HANDOVER_REFERENCES)]
        return t0_match_figures(at_t0, real, held_out, cfg.seed)
