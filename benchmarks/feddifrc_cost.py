"""Wall-time cost per round of FedDifRC's regularisers (and MOON's) against plain FedAvg local training.

    python benchmarks/feddifrc_cost.py [--dataset mnist-5k] [--clients 3] [--repeats 3] [--prior tiny] [--epochs 2]
                                       [--dynamic 0.5]

For each of the first `--clients` clients of a Dirichlet(0.5) split over 10 clients (the FedDifRC table's
dataset and local epochs by default), one
round of local training (clients.classify.local_train, the loop every method shares) runs with
each variant, interleaved variant by variant within a repeat so that the machine's changing load
hits all alike; the table gives the median seconds per round (summed over the clients) and the
ratio to FedAvg measured in the same run. The one-off cost of the diffusion representations
(UNet passes + PCA, cached for every later round) and their memory are printed beside it.
`FedDifRC, dynamic condition` (`feddifrc.dynamic-condition` > 0) also recomputes F~ under c_i = h_k(x_i) from
the received model inside its round, as its clients do every round (clients.feddifrc.dynamic_targets).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from experiments.cli import common_args, pin_threads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                parents=[common_args(dataset="mnist-5k", threads=1)])
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--prior", default="tiny", help="tiny (the dataset's cached tiny prior) or a prior folder")
    p.add_argument("--dynamic", type=float, default=0.5,
                   help="feddifrc.dynamic-condition of the dynamic variant (the table's row: 0.5)")
    a = p.parse_args()
    pin_threads(a.threads)

    import clients.feddifrc as fd
    import clients.moon as mn
    from clients.classify import local_train
    from fedapp.client_context import ClientContext
    from fedapp.config import all_defaults, parse_run_config
    from fedapp.models.classifier import build_classifier
    from fedapp.protocols.feddifrc import feddifrc_classifier

    flat = {**all_defaults(), "method": "feddifrc", "dataset": a.dataset, "prior": a.prior,
            "partitioner.name": "dirichlet", "partitioner.per-class": 0,
            "partitioner.alpha": 0.5, "device": "cpu", "local-epochs": a.epochs}
    cfg = parse_run_config(flat)
    o = cfg.options
    ctxs = [ClientContext(cfg=cfg, partition_id=i, num_partitions=10) for i in range(a.clients)]

    t0 = time.time()
    targets = [fd.compute_targets(c) for c in ctxs]
    feat_s = time.time() - t0
    n_img = sum(len(c.shard.train) for c in ctxs)
    cache = sum(t.nbytes for t in targets)

    torch.manual_seed(0)
    plain = build_classifier(cfg.model, 10)
    proj = feddifrc_classifier(cfg, 10)  # FedDifRC's model: z is the embedding (or a head, feddifrc.feature-on)
    proj_moon = build_classifier(cfg.model, 10, proj_dim=128)
    prev_moon = copy.deepcopy(proj_moon).eval().requires_grad_(False)

    dyn_ctxs = [ClientContext(cfg=parse_run_config({**flat, "feddifrc.dynamic-condition": a.dynamic}),
                              partition_id=i, num_partitions=10) for i in range(a.clients)]
    _ = [c.shard for c in dyn_ctxs]  # loaded before the timed rounds

    def variants(i):
        """name -> (the round's starting model, model -> its extra loss): the loss is built inside the timed
        round, because the dynamic condition's targets depend on the model the client receives."""
        t = targets[i]

        def difrc(tdcl: float, ndcr: float):
            return lambda model: fd.FedDifRCLoss(t, tdcl, ndcr, o.tau, o.ndcr_form)

        def dynamic(model):
            return fd.FedDifRCLoss(fd.dynamic_targets(dyn_ctxs[i], t, model), o.lambda_tdcl, o.lambda_ndcr,
                                   o.tau, o.ndcr_form)

        return {
            "FedAvg": (plain, lambda model: None),
            "+TDCL only": (proj, difrc(o.lambda_tdcl, 0.0)),
            "+NDCR only": (proj, difrc(0.0, o.lambda_ndcr)),
            "FedDifRC": (proj, difrc(o.lambda_tdcl, o.lambda_ndcr)),
            "FedDifRC, dynamic condition": (proj, dynamic),
            "MOON": (proj_moon, lambda model: mn.MoonLoss(copy.deepcopy(proj_moon).eval().requires_grad_(False),
                                                          prev_moon, 1.0, 0.5)),
        }

    times: dict[str, list[float]] = {k: [] for k in variants(0)}
    for _ in range(a.repeats):
        for name in times:
            total = 0.0
            for i, c in enumerate(ctxs):
                model, loss_for = variants(i)[name]
                model = copy.deepcopy(model)
                t1 = time.perf_counter()
                reg = loss_for(model)
                local_train(model, c.shard.train.x, c.shard.train.y, epochs=a.epochs, lr=cfg.lr, batch=cfg.batch_size,
                            seed=i, extra_loss=reg)
                total += time.perf_counter() - t1
            times[name].append(total)

    base = statistics.median(times["FedAvg"])
    print(f"{a.dataset} dirichlet(0.5), {a.clients} clients ({n_img} images), {a.epochs} local epochs, "
          f"batch {cfg.batch_size}, "
          f"{a.threads} thread(s), median of {a.repeats} interleaved repeats")
    print("| variant | s / round (all clients) | ratio to FedAvg |\n|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {med / base:.2f}x |")
    from fedapp.models.classifier import embedding_dim
    from fedapp.protocols.feddifrc import num_up_blocks

    dims = o.target_dims(num_up_blocks(cfg), embedding_dim(cfg.model))
    print(f"\nOne-off diffusion representations (t={o.t}, PCA dims {'/'.join(map(str, dims))} over {len(dims)} "
          f"up-blocks, {10 + 1} prompts per image): {feat_s:.1f} s for {n_img} images = {feat_s / max(base, 1e-9):.1f} "
          f"FedAvg rounds; cached: {cache} bytes ({cache / n_img:.0f} bytes per image)")


if __name__ == "__main__":
    main()
