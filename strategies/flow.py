"""What DCFM and its baselines share on the server (protocol: fedapp/protocols/dcfm.py).

- `FlowTask`: the composition data, the one velocity net every method trains (experts, DCFM-B's
  student and FedFlow's global model have one shape, so one upload check and one model size).
- `FlowEvaluation`: samples for every seen and every novel (digit, colour) pair from a method's
  velocity field, read by reference classifiers trained on real data; model transfers counted from
  the metered bytes. Held by composition, so that the phased methods and FedFlow's Flower round loop
  end with the same figures.
- `FlowStrategy`: the phased methods' base (dcfm, ddm, local-only-flow): Stage I and the experts it keeps.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from flwr.app import ArrayRecord, Message, RecordDict

from fedapp.options import ConfigError
from fedapp.images import save_pair_grid
from fedapp.models.compose import attribute_labels, build_velocity, generate, of_pairs
from fedapp.protocols import RUN_KEY
from fedapp.protocols import dcfm as P
from fedapp.protocols.records import dtypes_of, partition_of, record_nbytes, run_config_record, tensors_of
from fedapp.readers import Reader, reader_metrics, server_reader
from fedapp.server import PhasedStrategy, ServerRun

log = logging.getLogger("fedapp")

# (requested labels y, part) -> the velocity field (x, t) -> v a method samples with; `part` lets
# local-only-flow split the requests across its experts
Sampler = Callable[[torch.Tensor, int], Callable]


class FlowTask:
    """The composition data on the server and the velocity net every upload must match."""

    def __init__(self, run: ServerRun[P.DcfmOptions], server):
        cfg = run.cfg
        if "novel_pairs" not in server.meta:
            from feddata import with_attribute

            raise ConfigError(f"method={cfg.method!r} needs pairs of attributes: dataset="
                              f"{' or '.join(with_attribute('color'))} with partitioner=attribute-holdout "
                              f"(got {cfg.dataset}, {cfg.partitioner})")
        self.run, self.server, self.opts = run, server, cfg.options
        self.sizes = P.attribute_sizes(server.info)
        self.shape = (server.info.channels, cfg.image_size, cfg.image_size)
        net = self.new_model()
        self.expected = {k: tuple(v.shape) for k, v in net.state_dict().items()}
        self.dtypes = dtypes_of(ArrayRecord(net.state_dict()))  # an integer upload is never averaged in
        # one model transfer = the serialised ArrayRecord of a velocity net, as the MeteredGrid counts it
        self.model_bytes = record_nbytes(RecordDict({P.EXPERT_KEY: ArrayRecord(net.state_dict())}))

    def new_model(self):
        torch.manual_seed(self.run.cfg.seed)
        return build_velocity(self.run.cfg.image_size, self.sizes, self.opts.width, self.server.info.channels,
                              self.opts.label_embedding)

    def load(self, state: dict[str, torch.Tensor]):
        m = self.new_model()
        m.load_state_dict(state)
        return m.to(self.run.device).eval().requires_grad_(False)

    def validate(self, content: RecordDict) -> str | None:
        """An expert upload (train, query.peer) against this run's velocity net."""
        return P.validate_expert(content, self.expected, self.sizes, self.run.cfg.max_upload_bytes, self.dtypes)


class FlowEvaluation:
    """The final figures of every composition method, from its sampler and the run's metered bytes."""

    def __init__(self, run: ServerRun[P.DcfmOptions], task: FlowTask):
        self.run, self.task, self.opts = run, task, task.opts

    def reference_classifiers(self) -> dict[str, Reader]:
        """Readers (fedapp.readers) for digit and for colour, trained on the dataset's real images outside its
        test split (fedapp.readers.reader_split), so that their accuracy on the real test images is held out.
        (Not Inception: Frechet distances below are on these classifiers' features.)"""
        s, seed, epochs = self.task.server, self.run.cfg.seed, self.opts.ref_epochs
        return {a: server_reader(s, seed + i, a, epochs=epochs) for i, a in enumerate(P.ATTRS)}

    @torch.no_grad()
    def generate_pairs(self, sampler: Sampler, parts: int, pairs: list[list[int]],
                       seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.opts.samples_per_pair
        y = torch.tensor(pairs, dtype=torch.long).repeat_interleave(n, 0)
        x = torch.zeros(len(y), *self.task.shape)
        for p in range(parts):  # local-only: each expert answers every parts-th request
            yp = y[p::parts]
            if len(yp):
                field = sampler(yp.to(self.run.device), p)
                x[p::parts] = generate(field, (len(yp), *self.task.shape), self.opts.sample_steps, seed + p,
                                       self.run.device).cpu()
        return x, y

    def evaluate(self, sampler: Sampler, parts: int = 1) -> dict[str, Any]:
        from fedapp.metrics import composition_accuracy, feature_distances
        from fedapp.models.classifier import embed_all, predict

        with self.run.phase("evaluation"):
            readers = self.reference_classifiers()
            ref = {a: r.model for a, r in readers.items()}
            server = self.task.server
            test = server.test
            ty = attribute_labels(test, P.ATTRS)
            out: dict[str, Any] = reader_metrics(readers.values())
            samples = {}
            for kind in ("seen", "novel"):
                pairs = server.meta[f"{kind}_pairs"]
                x, y = self.generate_pairs(sampler, parts, pairs, self.run.cfg.seed + (0 if kind == "seen" else 1000))
                samples[kind] = (x, y)
                pred = [predict(ref[a], x) for a in P.ATTRS]
                out[f"{kind}_composition_accuracy"] = composition_accuracy(pred[0], pred[1], y[:, 0], y[:, 1])
                out[f"{kind}_digit_accuracy"] = float((pred[0] == y[:, 0]).float().mean())
                out[f"{kind}_color_accuracy"] = float((pred[1] == y[:, 1]).float().mean())
                real = of_pairs(ty, pairs)
                # Frechet distance and KID on the concatenated digit + colour reference features (not Inception)
                fr = torch.cat([embed_all(ref[a], test.x[real].float()) for a in P.ATTRS], 1).numpy()
                fg = torch.cat([embed_all(ref[a], x) for a in P.ATTRS], 1).numpy()
                out.update(feature_distances(kind, fg, fr, seed=self.run.cfg.seed))
            # digit x colour grid, one sample per cell; novel cells framed in white
            save_pair_grid(samples, self.task.sizes, server.meta["novel_pairs"],
                           self.run.out.path("images", "grid.png"))
        return out

    def comm_metrics(self) -> dict[str, Any]:
        """Model transfers per client, counted from the metered messages: (bytes up + down) / model bytes."""
        # the run config rides on every message down; it is not a model transfer
        cfg_bytes = record_nbytes(RecordDict({RUN_KEY: run_config_record(self.run.cfg.flat())}))
        per = self.run.comm()["per_client"]
        model_bytes = self.task.model_bytes
        transfers = {c: (r["up_bytes"] + r["down_bytes"] - r["messages_down"] * cfg_bytes) / model_bytes
                     for c, r in per.items()}
        vals = list(transfers.values()) or [0.0]
        return {"model_bytes": model_bytes,
                "model_transfers_per_client": round(sum(vals) / len(vals), 3),
                "model_transfers_by_client": {c: round(v, 3) for c, v in sorted(transfers.items())}}

    def finish(self, sampler: Sampler, extra: dict[str, Any], num_experts: int, parts: int = 1) -> dict[str, Any]:
        """The summary's metrics: evaluation, the method's own figures, transfers; logged as the final row."""
        metrics = {**self.evaluate(sampler, parts), **extra}
        metrics.update(self.comm_metrics())
        metrics["num_experts"] = num_experts
        self.run.out.log_metrics({"phase": "final", **metrics})
        log.info("[%s] seen acc %.3f novel acc %.3f seen FD %.2f novel FD %.2f, %.2f transfers/client",
                 self.run.cfg.method, metrics["seen_composition_accuracy"], metrics["novel_composition_accuracy"],
                 metrics["seen_distance"], metrics["novel_distance"], metrics["model_transfers_per_client"])
        return metrics


class FlowStrategy(PhasedStrategy):
    """A phased composition method: Stage I experts, the method's own phases, the shared evaluation."""

    run: ServerRun[P.DcfmOptions]

    def __init__(self, run: ServerRun[P.DcfmOptions]):
        super().__init__(run)
        self.opts: P.DcfmOptions = run.cfg.options
        self.experts: dict[int, Any] = {}  # partition id -> frozen velocity net
        self.counts: dict[int, torch.Tensor] = {}  # partition id -> n_a(y_1, y_2)
        self.node_of: dict[int, int] = {}  # partition id -> node id

    def setup(self, grid) -> list[int]:
        nodes = sorted(grid.get_node_ids())
        self.task = FlowTask(self.run, self.server_data(len(nodes)))
        self.evaluation = FlowEvaluation(self.run, self.task)
        return nodes

    def keep_experts(self, replies: list[Message]) -> None:
        """Load the validated experts and their pair counts, by the partition id each reply claims."""
        for r in replies:
            pid = partition_of(r)
            pid = pid if pid is not None else r.metadata.src_node_id
            self.node_of[pid] = r.metadata.src_node_id
            self.experts[pid] = self.task.load(tensors_of(r.content.array_records[P.EXPERT_KEY]))
            self.counts[pid] = tensors_of(r.content.array_records[P.COUNTS_KEY])[P.PAIRS].long()
        if replies:
            log.info("[%s] experts of clients %s", replies[0].metadata.message_type, sorted(self.experts))

    def stage_one(self, grid, nodes: list[int], lambda_ci: float) -> None:
        """The train phase: every client trains its expert from scratch with L_FM + lambda L_CI
        (lambda 0: plain masked L_FM) and uploads it with its pair counts (one model transfer up)."""
        phase = {P.PHASE_KEY: P.phase_record(lambda_ci)}
        with self.run.phase("stage1"):
            self.keep_experts(self.exchange(grid, P.TRAIN, nodes, lambda n: phase, self.task.validate))

    def frozen(self) -> tuple[list[int], dict[int, ArrayRecord]]:
        """The experts' partition ids (sorted) and their weights as records to send."""
        ids = sorted(self.experts)
        return ids, {a: ArrayRecord({k: v.cpu() for k, v in self.experts[a].state_dict().items()}) for a in ids}

    def sampler(self, y: torch.Tensor, part: int) -> Callable:  # pragma: no cover - abstract
        """The velocity field (x, t) -> v for requested labels y; `part` splits work across experts."""
        raise NotImplementedError

    def parts(self) -> int:
        return 1

    def finish(self, extra: dict[str, Any]) -> dict[str, Any]:
        return self.evaluation.finish(self.sampler, extra, num_experts=len(self.experts), parts=self.parts())
