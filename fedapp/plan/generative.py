"""The generative methods' work: PFDM and its DDPM baselines (pfdm.*), DCFM and its flow baselines
(dcfm.*), counted as their clients and strategies run them. The evaluation's reference classifiers, the
attacks and the distances are left out (each run's notes say so); so are DDM's router steps.
"""

from __future__ import annotations

import math

from fedapp.plan.counts import sampled
from fedapp.plan.ledger import Ledger, ceil_div

COMPOSITE_QUERIES = 4  # label sets of one composite velocity for two attributes: y, ∅, (y_1, ∅), (∅, y_2)


def ddpm_spec(cfg, facts, flag: bool) -> dict:
    return {"kind": "ddpm", "image_size": cfg.image_size, "num_classes": facts.num_classes, "flag": flag,
            "widths": cfg.options.channels, "channels": facts.channels}


def ddim_calls(steps: int, t_start: int, t_end: int) -> int:
    """UNet calls of DDPM.sample with `steps` DDIM steps from t_start to t_end (its unique levels - 1)."""
    import torch

    return len(torch.linspace(t_start, t_end, steps + 1).round().long().unique_consecutive()) - 1


def pfdm(led: Ledger, cfg, facts, arch=None) -> None:
    """Private denoisers and releases (train), the server's shared denoiser, personalised sampling."""
    from fedapp.models.ddpm import AUTO_HANDOVER, shared_objective, split_steps
    from fedapp.privacy import resolve_t0

    o, T = cfg.options, 1000
    t0 = resolve_t0(o.t0, o.epsilon, o.clip, o.delta, o.accountant)
    led.modules["ddpm.private"] = ddpm_spec(cfg, facts, flag=True)
    led.modules["ddpm.shared"] = ddpm_spec(cfg, facts, flag=False)
    (lowest, _), _ = shared_objective(o.shared, t0, T)
    handover = AUTO_HANDOVER[o.shared] if o.handover == "auto" else o.handover
    k_shared, k_private = split_steps(o.sample_steps, t0, T)
    shared_calls = T - lowest if handover == "ancestral" else ddim_calls(k_shared, T, lowest)
    led.figures.update({"t0": t0, "handover": handover, "samples per client": 2 * o.samples})
    for k, n in enumerate(facts.n_train):
        rows = min(o.batch, 2 * n)  # every image twice: unclipped and clipped
        retrain = 1 if o.private_levels == "all" else 2  # the private-only reference learns every level
        led.add("client: private denoiser steps", "ddpm.private", "train", rows, o.local_steps * retrain, k)
        led.add("client: shared leg T -> t0", "ddpm.shared", "infer", o.samples, shared_calls, k)
        led.add("client: private leg t0 -> 0", "ddpm.private", "infer", o.samples, ddim_calls(k_private, t0, 0), k)
        led.add("client: private-only samples", "ddpm.private", "infer", o.samples, ddim_calls(o.sample_steps, T, 0), k)
    led.add("server: shared denoiser steps", "ddpm.shared", "train", min(o.batch, sum(facts.n_train)), o.shared_steps)
    n_match = min(o.attack_samples, facts.server_test, facts.public)
    led.add("server: hand-over check at t0", "ddpm.shared", "infer", n_match, shared_calls)
    led.note("pfdm: reference classifier, distances and attacks of the evaluation are not counted")


def local_only(led: Ledger, cfg, facts, arch=None) -> None:
    o = cfg.options
    led.modules["ddpm"] = ddpm_spec(cfg, facts, flag=False)
    for k, n in enumerate(facts.n_train):
        led.add("client: local DDPM steps", "ddpm", "train", min(o.batch, n), o.local_steps, k)
        led.add("client: samples", "ddpm", "infer", o.samples, ddim_calls(o.sample_steps, 1000, 0), k)
    led.note("local-only: the evaluation's reference classifier and distances are not counted")


def fedavg_ddpm(led: Ledger, cfg, facts, arch=None) -> None:
    """fedavg-ddpm and dpdm: ceil(local-steps / rounds) steps a round per sampled client, then the released
    model sampled once on the server."""
    o, rounds = cfg.options, cfg.num_server_rounds
    led.modules["ddpm"] = ddpm_spec(cfg, facts, flag=False)
    share = sampled(facts.num_clients, cfg.fraction_train, cfg.min_clients) / facts.num_clients
    for k, n in enumerate(facts.n_train):
        steps = ceil_div(o.local_steps, rounds) * rounds * share  # clients.ddpm_baselines.steps_per_round
        led.add("client: DDPM steps", "ddpm", "train", min(o.batch, n), steps, k)
    released_samples(led, cfg)
    if cfg.method == "dpdm":
        led.note("dpdm: DP-SGD's per-sample gradients (Opacus) cost more than the plain step timed")


def centralized_ddpm(led: Ledger, cfg, facts, arch=None) -> None:
    o = cfg.options
    led.modules["ddpm"] = ddpm_spec(cfg, facts, flag=False)
    led.add("server: DDPM steps on the union (oracle)", "ddpm", "train", min(o.batch, sum(facts.n_train)),
            o.shared_steps)
    released_samples(led, cfg)


def released_samples(led: Ledger, cfg) -> None:
    o = cfg.options
    led.add("server: samples of the released model", "ddpm", "infer", o.samples, ddim_calls(o.sample_steps, 1000, 0))
    led.note(f"{cfg.method}: the evaluation's reference classifier, distances and MIA are not counted")


# ---- DCFM and its flow baselines ----------------------------------------------------------------------
def velocity_spec(cfg, facts) -> dict:
    """The velocity net of the run; the data must have attribute pairs (strategies.flow.FlowTask's check)."""
    from fedapp.options import ConfigError
    from fedapp.protocols import dcfm as P

    if "novel_pairs" not in facts.meta:
        from feddata import with_attribute

        raise ConfigError(f"method={cfg.method!r} needs pairs of attributes: dataset="
                          f"{' or '.join(with_attribute('color'))} with partitioner=attribute-holdout "
                          f"(got {cfg.dataset}, {cfg.partitioner})")
    o = cfg.options
    return {"kind": "velocity", "image_size": cfg.image_size, "channels": facts.channels, "width": o.width,
            "sizes": [facts.attribute_sizes.get(a, 1) for a in P.ATTRS], "label_embedding": o.label_embedding}


def expert_steps(led: Ledger, what: str, cfg, n: int, steps: float, ci: bool, client: int) -> None:
    """Steps of train_expert / distill_student: L_FM on min(batch, n) rows, and with a CI term its
    COMPOSITE_QUERIES label sets on ci-batch rows (all rows when 0) in one more batched forward."""
    rows = min(cfg.batch_size, n)
    led.add(what, "velocity", "train", rows, steps, client)
    if ci:
        ci_rows = rows if cfg.options.ci_batch <= 0 else min(cfg.options.ci_batch, rows)
        led.add(what + " (CI queries)", "velocity", "train", COMPOSITE_QUERIES * ci_rows, steps, client)


def flow_evaluation(led: Ledger, cfg, facts, rows_per_sample: int, calls_per_step: int) -> None:
    """FlowEvaluation.generate_pairs: samples-per-pair for every seen and novel pair, sample-steps Euler steps."""
    o = cfg.options
    pairs = len(facts.meta.get("seen_pairs", [])) + len(facts.meta.get("novel_pairs", []))
    n = o.samples_per_pair * pairs
    led.figures["evaluation samples"] = n
    led.add("server: evaluation samples (Euler steps)", "velocity", "infer", n * rows_per_sample,
            o.sample_steps * calls_per_step)
    led.note(f"{cfg.method}: the reference classifiers and distances of the evaluation are not counted")


def dcfm(led: Ledger, cfg, facts, arch=None) -> None:
    o, N = cfg.options, facts.num_clients
    led.modules["velocity"] = velocity_spec(cfg, facts)
    for k, n in enumerate(facts.n_train):
        expert_steps(led, "client: Stage I expert steps", cfg, n, o.local_steps, o.lambda_ci > 0, k)
        if o.variant == "a":
            expert_steps(led, "client: peer-CI steps", cfg, n, o.peer_steps * o.rounds, o.lambda_ci > 0, k)
    if o.variant == "b":
        teacher = o.replay == "teacher"
        # teacher: each of the N teachers drives its share of the paths; composite: every expert, all label sets
        rows = math.ceil(o.replay_paths / N) if teacher else COMPOSITE_QUERIES * o.replay_paths
        led.add("server: replay paths", "velocity", "infer", rows, o.path_steps * N)
        expert_steps(led, "server: student distillation steps", cfg, o.replay_paths * o.path_steps, o.distill_steps,
                     o.lambda_ci > 0, -1)
        flow_evaluation(led, cfg, facts, COMPOSITE_QUERIES, 1)
    else:
        flow_evaluation(led, cfg, facts, COMPOSITE_QUERIES, N)


def fedflow(led: Ledger, cfg, facts, arch=None) -> None:
    o = cfg.options
    led.modules["velocity"] = velocity_spec(cfg, facts)
    share = sampled(facts.num_clients, cfg.fraction_train, cfg.min_clients) / facts.num_clients
    for k, n in enumerate(facts.n_train):
        expert_steps(led, "client: local FedFlow steps", cfg, n, o.fl_local_steps * cfg.num_server_rounds * share,
                     False, k)
    flow_evaluation(led, cfg, facts, 1, 1)


def flow_experts(led: Ledger, cfg, facts, arch=None) -> None:
    """ddm and local-only-flow: Stage I experts with plain masked L_FM; ddm's router data (each expert's
    own ODE samples) and routed sampling over every expert; local-only-flow's experts split the requests."""
    o, N = cfg.options, facts.num_clients
    led.modules["velocity"] = velocity_spec(cfg, facts)
    for k, n in enumerate(facts.n_train):
        expert_steps(led, "client: expert steps", cfg, n, o.local_steps, False, k)
    if cfg.method == "ddm":
        led.add("server: router data (expert ODE samples)", "velocity", "infer", 64, o.sample_steps * N)
        led.note("ddm: the router's own steps and its holder-weight probe are not counted")
        flow_evaluation(led, cfg, facts, 1, N)
    else:
        flow_evaluation(led, cfg, facts, 1, 1)
