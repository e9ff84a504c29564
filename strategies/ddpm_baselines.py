"""PFDM's generation baselines, scored exactly like pfdm
(strategies/generation_eval.py: GenerationEval). Protocol: fedapp/protocols/pfdm.py.

- `local-only`: every client trains a DDPM on its own data and nothing else (non-collaborative).
  Releases no model, so there is no membership-inference target: mia_* are null.
- `fedavg-ddpm`: FedAvg over one class-conditional DDPM on Flower's round loop (FedDM-like, not
  private). The final global model is released: the server samples it (the same model serves every
  client) and attacks it with the loss-threshold MIA (members = client 0's training images).
- `dpdm`: as fedavg-ddpm, each client training with DP-SGD (clients/dpdm.py); the run reports the
  largest epsilon any client spent (each client's Opacus accountant), released model scored the same way.
- `centralized-ddpm`: ORACLE, NOT A FEDERATED PROTOCOL (the name `centralized` is the classifier
  ceiling): the server loads every client's shard and trains one DDPM on the union.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from flwr.app import MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedapp.data import all_client_shards
from fedapp.models.checkpoints import run_train_state
from fedapp.models.ddpm import build_ddpm, train_ddpm
from fedapp.protocols import pfdm as P
from fedapp.protocols.records import partition_of, tensors_of
from fedapp.protocols.weights import load_weights, weights_record
from fedapp.server import PhasedStrategy, RoundStrategy, ServerRun
from fedapp.server.checkpoint import save_model
from strategies.generation_eval import GenerationEval, memorisation, sample_model

log = logging.getLogger("fedapp")

NO_MIA = {"mia_auc": None, "mia_attack_accuracy": None, "mia_tpr_at_1fpr": None}


def score_released_model(run: ServerRun[P.PFDMOptions], ev: GenerationEval, model, num_partitions: int,
                         name: str) -> dict[str, Any]:
    """One model for every client: its samples' distances (the same for each client), MIA against
    client 0's training images and the memorisation check against every client's training images."""
    cfg, o = run.cfg, run.cfg.options
    x, y = sample_model(model, o.samples, ev.num_classes, o.sample_steps, cfg.seed + 3)
    ev.save_grid(x, y, f"{name}.png")
    metrics = ev.per_client({0: (x, y)})
    shards = all_client_shards(cfg, num_partitions)  # EVALUATION ORACLE
    metrics.update(ev.mia_clean(model, shards[0].train.x, shards[0].train.y))
    metrics.update({f"shared_{k}": v for k, v in memorisation(x, torch.cat([s.train.x for s in shards])).items()})
    metrics.update(ev.reader_figures())
    return metrics


class LocalOnlyStrategy(PhasedStrategy):
    run: ServerRun[P.PFDMOptions]

    def execute(self, grid) -> dict[str, Any]:
        run = self.run
        nodes = sorted(grid.get_node_ids())
        ev = GenerationEval(run, len(nodes))
        got = self.exchange(grid, P.LOCAL_SAMPLE, nodes, validate=lambda c: P.validate_samples(c, ev.shape))
        samples = {partition_of(r): tensors_of(r.content.array_records[P.SAMPLES_KEY]) for r in got}
        for p, s in samples.items():
            ev.save_grid(s[P.X], s[P.Y], f"local_only_client{p}.png")
        metrics = ev.per_client({p: (s[P.X], s[P.Y]) for p, s in samples.items()})
        metrics.update(NO_MIA)
        metrics.update(ev.reader_figures())
        run.out.log_metrics({"phase": "final", **metrics})
        return metrics


class FedAvgDDPMStrategy(RoundStrategy):
    """FedAvg over the DDPM: uploads are FedAvg's (the global DDPM's exact keys, shapes, dtypes); no
    evaluate round, the released model is scored once on the server."""

    train_phase = P.FEDAVG_TRAIN
    name = "fedavg_ddpm"
    run: ServerRun[P.PFDMOptions]

    def __init__(self, run: ServerRun[P.PFDMOptions]):
        super().__init__(run, train_metrics_aggr_fn=self.aggregate_train_metrics)

    @staticmethod
    def aggregate_train_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
        return aggregate_metricrecords(records, weight_key)  # Flower's weighted mean

    def final_metrics(self, result) -> dict[str, Any]:
        return {}

    def execute(self, grid) -> dict[str, Any]:
        cfg, run = self.run.cfg, self.run
        nodes = sorted(grid.get_node_ids())
        ev = GenerationEval(run, len(nodes))
        torch.manual_seed(cfg.seed)
        model = build_ddpm(cfg.image_size, ev.num_classes, flag=False, channels=cfg.options.channels)
        initial = weights_record(model.state_dict())  # packed, as FedAvg's (clients.classify.train_reply)
        self.expect(initial)
        result = self.run_rounds(grid, initial)
        load_weights(model, result.arrays)
        save_model(run.out, model.state_dict())
        with run.phase("evaluation"):
            metrics = score_released_model(run, ev, model.eval(), len(nodes), f"{self.name}_global")
        metrics.update(self.final_metrics(result))
        run.out.log_metrics({"phase": "final", **metrics})
        return metrics


class DPDMStrategy(FedAvgDDPMStrategy):
    """FedAvg over the DDPM with DP-SGD clients; the released model's guarantee is the worst client's."""

    train_phase = P.DPDM_TRAIN
    name = "dpdm"

    @staticmethod
    def aggregate_train_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
        """Flower's weighted mean, except the privacy figures: the largest any client reports."""
        out = aggregate_metricrecords(records, weight_key)
        for key in (P.DP_EPSILON_METRIC, P.DP_NOISE_METRIC):
            out[key] = max(float(next(iter(r.metric_records.values()))[key]) for r in records)
        return out

    def final_metrics(self, result) -> dict[str, Any]:
        last = result.train_metrics_clientapp[max(result.train_metrics_clientapp)]
        return {"dp_epsilon": float(last[P.DP_EPSILON_METRIC]), "dp_delta": self.run.cfg.options.delta,
                "dp_noise_multiplier_max": float(last[P.DP_NOISE_METRIC])}


class CentralizedDDPMStrategy(PhasedStrategy):
    """An oracle: no exchange with the clients."""

    run: ServerRun[P.PFDMOptions]

    def execute(self, grid) -> dict[str, Any]:
        cfg, o, run = self.run.cfg, self.run.cfg.options, self.run
        nodes = sorted(grid.get_node_ids())
        log.warning("centralized-ddpm: an ORACLE; the server reads all %d clients' real data", len(nodes))
        ev = GenerationEval(run, len(nodes))
        shards = all_client_shards(cfg, len(nodes))
        x = torch.cat([s.train.x for s in shards])
        y = torch.cat([s.train.y for s in shards])
        with run.phase("centralized-ddpm"):
            torch.manual_seed(cfg.seed)
            model = build_ddpm(cfg.image_size, ev.num_classes, flag=False, channels=o.channels)
            train_ddpm(model, x, y, steps=o.shared_steps, batch=o.batch, lr=o.lr, seed=cfg.seed, device=run.device,
                       ema=o.ema, p_uncond=o.p_uncond, state=run_train_state(cfg, "centralized-ddpm"))
        save_model(run.out, model.state_dict())
        metrics = score_released_model(run, ev, model.cpu().eval(), len(nodes), "centralized_ddpm")
        metrics.update({"oracle": True, "num_train": len(x)})
        run.out.log_metrics({"phase": "final", **metrics})
        return metrics
