"""A plan as a JSON-ready dict (`assemble`) and as a readable table (`table`)."""

from __future__ import annotations

from typing import Any

from fedapp.plan.ledger import SERVER


def _term_row(term, timer) -> dict[str, Any]:
    row = {"what": term.what, "side": term.side, "module": term.module, "mode": term.mode, "rows": term.rows,
           "calls": term.calls, "evals": term.evals,
           "calls_per_client": {str(k): v for k, v in sorted(term.calls_by.items()) if k != SERVER}}
    if timer is not None:
        t = timer.seconds(term.module, term.mode, term.rows)
        row.update(seconds_per_call=t.seconds, seconds=t.seconds * term.calls, basis=t.basis)
        row["seconds_per_client"] = {k: t.seconds * v for k, v in row["calls_per_client"].items()}
    return row


def _prior(arch, terms: list[dict]) -> dict[str, Any] | None:
    if arch is None:
        return None
    from fedapp.plan.arch import parameter_counts
    from fedapp.plan.footprint import unet_footprint

    def largest(mode: str) -> int:  # the largest call of each kind: synthesis batches, condition learning
        return max((t["rows"] for t in terms if t["module"] == "prior.unet" and t["mode"] == mode), default=0)

    return {"source": arch.source, "image_size": arch.image_size, "latent_shape": list(arch.latent_shape),
            "cond_shape": list(arch.cond_shape), "parameters": parameter_counts(arch),
            "unet_memory": unet_footprint(arch, largest("infer"), largest("grad-input"))}


def _totals(terms: list[dict], facts, cfg, timed: bool) -> dict[str, Any]:
    def total(pred, key="evals") -> float:
        return sum(t[key] for t in terms if pred(t))

    out = {"model_evals_server": total(lambda t: t["side"] == "server"),
           "model_evals_clients": total(lambda t: t["side"] == "client"),
           "classifier_steps_server": total(lambda t: t["module"] == "classifier" and t["side"] == "server"
                                            and t["mode"] == "train", "calls"),
           "classifier_steps_per_round": total(lambda t: t["module"] == "classifier" and t["side"] == "client"
                                               and t["mode"] == "train", "calls") / cfg.num_server_rounds}
    if timed:
        per_client = [sum(t["seconds_per_client"].get(str(k), 0.0) for t in terms) for k in range(facts.num_clients)]
        server = total(lambda t: t["side"] == "server", "seconds")
        out.update(seconds_server=server, seconds_per_client=per_client, seconds_clients=sum(per_client),
                   wall_seconds_in_process=server + sum(per_client),
                   wall_seconds_parallel_clients=server + max(per_client, default=0.0))
    return out


def _comm(comm) -> dict[str, Any]:
    per = comm.per_client()
    return {"per_client": {str(k): v for k, v in per.items()},
            "down_bytes": sum(v["down"] for v in per.values()), "up_bytes": sum(v["up"] for v in per.values()),
            "by_phase": [{"phase": r.phase, "direction": r.direction, "bytes": r.total,
                          "messages": sum(r.messages_by.values())} for r in comm.rows.values()],
            "conditional": comm.conditional}


def assemble(cfg, facts, arch, led, comm, timer) -> dict[str, Any]:
    import torch

    from fedapp import registry
    from fedapp.server import RoundStrategy

    terms = [_term_row(t, timer) for t in led.all()]
    rounds = cfg.num_server_rounds if issubclass(registry.strategy_class(cfg.method), RoundStrategy) else None
    run = {"method": cfg.method, "dataset": cfg.dataset, "partitioner": cfg.partitioner, "prior": cfg.prior,
           "image_size": cfg.image_size, "num_clients": facts.num_clients, "rounds": rounds,
           "train_images_per_client": facts.n_train, "device": cfg.torch_device(),
           "torch_threads": torch.get_num_threads()}
    return {"run": run, "prior": _prior(arch if cfg.spec.uses_prior else None, terms), "terms": terms,
            "figures": led.figures, "totals": _totals(terms, facts, cfg, timer is not None), "comm": _comm(comm),
            "refusals": facts.refusals,
            "notes": led.notes + ["wall time: the counted calls only; start-up, data loading, messaging and the "
                                  "evaluation work named above are not in it"]}


# ---- the table -------------------------------------------------------------------------------------
def human(n: float, unit: str = "") -> str:
    for size, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= size:
            return f"{n / size:.3g} {suffix}{unit}"
    return f"{n:.3g} {unit}".rstrip()


def seconds(s: float) -> str:
    if s >= 86400:
        return f"{s / 86400:.1f} d"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 60:.1f} min" if s >= 120 else f"{s:.1f} s"


def table(plan: dict[str, Any]) -> str:
    lines = _header(plan) + _work(plan) + _bytes(plan) + _memory(plan)
    lines += [f"note: {n}" for n in plan["notes"]]
    return "\n".join(lines)


def _header(plan: dict[str, Any]) -> list[str]:
    r = plan["run"]
    images = ", ".join(map(str, r["train_images_per_client"][:6])) + (" ..." if r["num_clients"] > 6 else "")
    rounds = f"{r['rounds']} rounds" if r["rounds"] else "one-shot"
    out = [f"plan: {r['method']} on {r['dataset']} ({r['partitioner']}), {r['num_clients']} clients ({images} "
           f"training images), {r['image_size']} px, {rounds}, device {r['device']}, "
           f"{r['torch_threads']} torch threads"]
    out += [f"WARNING: {w}" for w in plan["refusals"]]
    for key, value in plan["figures"].items():
        out.append(f"  {key}: {value}")
    return out


def _work(plan: dict[str, Any]) -> list[str]:
    timed = "seconds" in (plan["terms"] or [{}])[0]
    out = ["", f"{'work':<44}{'side':<7}{'module':<17}{'mode':<11}{'rows':>6}{'calls':>10}{'evals':>10}"
           + (f"{'s/call':>9}{'total':>10}  basis" if timed else "")]
    for t in plan["terms"]:
        line = (f"{t['what'][:43]:<44}{t['side']:<7}{t['module']:<17}{t['mode']:<11}{t['rows']:>6}"
                f"{human(t['calls']):>10}{human(t['evals']) if t['evals'] else '-':>10}")
        if timed:
            line += f"{t['seconds_per_call']:>9.3g}{seconds(t['seconds']):>10}  {t['basis']}"
        out.append(line)
    tot = plan["totals"]
    out.append(f"model evaluations: server {human(tot['model_evals_server'])}, clients "
               f"{human(tot['model_evals_clients'])}; classifier steps: server "
               f"{human(tot['classifier_steps_server'])}, clients {human(tot['classifier_steps_per_round'])} per round")
    if timed:
        out.append(f"projected: server {seconds(tot['seconds_server'])}, clients {seconds(tot['seconds_clients'])} "
                   f"(max one client {seconds(max(tot['seconds_per_client'], default=0))}); wall in process "
                   f"{seconds(tot['wall_seconds_in_process'])}, clients in parallel "
                   f"{seconds(tot['wall_seconds_parallel_clients'])}")
    return out


def _bytes(plan: dict[str, Any]) -> list[str]:
    c = plan["comm"]
    out = ["", f"{'bytes':<24}{'dir':<6}{'messages':>10}{'bytes':>12}"]
    out += [f"{r['phase']:<24}{r['direction']:<6}{human(r['messages']):>10}{human(r['bytes'], 'B'):>12}"
            for r in c["by_phase"]]
    per = c["per_client"]
    if len(per) <= 6:
        out.append("per client: " + ", ".join(f"{k}: down {human(v['down'], 'B')} up {human(v['up'], 'B')}"
                                              for k, v in per.items()))
    else:  # a summary line at any number of clients
        for d in ("down", "up"):
            vals = sorted(v[d] for v in per.values())
            out.append(f"per client {d}: min {human(vals[0], 'B')}, median {human(vals[len(vals) // 2], 'B')}, "
                       f"max {human(vals[-1], 'B')}")
    out.append(f"total: down {human(c['down_bytes'], 'B')}, up {human(c['up_bytes'], 'B')}")
    out += [f"  + {k}: {human(v, 'B')}" for k, v in c["conditional"].items()]
    return out


def _memory(plan: dict[str, Any]) -> list[str]:
    p = plan["prior"]
    if p is None:
        return ["", "prior: none (this method runs no diffusion prior)"]
    m = p["unet_memory"]
    out = ["", f"prior: {p['source']}",
           f"  {p['image_size']} px, latents {tuple(p['latent_shape'])}, conditions {tuple(p['cond_shape'])}; "
           + ", ".join(f"{k} {human(v)} parameters" for k, v in p["parameters"].items()),
           f"  UNet weights {human(m['weight_bytes'], 'B')} (float32)"]
    if "infer_rows" in m:
        out.append(f"  inference at {m['infer_rows']} rows: activations ~{human(m['infer_activation_bytes'], 'B')}, "
                   f"{human(m['infer_flops_per_call'], 'FLOP')} a call")
    if "train_rows" in m:
        out.append(f"  condition learning at {m['train_rows']} rows: saved activations "
                   f"~{human(m['train_activation_bytes'], 'B')}, {human(m['train_flops_per_call'], 'FLOP')} a step")
    return out
