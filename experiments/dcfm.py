"""DCFM's Colored-MNIST-style table on colored-digits: Frechet distance on reference-classifier features
and composition accuracy, seen vs novel (digit, colour) pairs, IID vs non-IID, for fedflow, ddm,
ddm+l (the paper's DDM+L: DDM over experts trained with L_CI, DCFM's Stage I), local-only-flow, DCFM-A
(peer rounds one client after another), DCFM-A as the paper runs it (dcfm-a-allgather) and DCFM-B. Every
A row keeps the composites' residuals and the experts' gauge figures after Stage I and after each peer
round (`ci_by_round`: strategies.dcfm.DcfmStrategy.round_record).

    python -m experiments dcfm [--clients 5] [--seeds 0,1,2] [--quick] [--out docs/results]
    # a budget sweep of one run-config key over some rows: each value is a row of its own,
    # "<row>@<key>=<value>", written to <out>/dcfm[_<dataset>]_sweep_<key>.json; Stage I is shared
    python -m experiments dcfm --rows dcfm-b --splits non-iid --sweep dcfm.distill-steps=500,1000,2000

Writes <out>/dcfm[_<dataset>].json (one row per run, merged in under a lock after each run, so an interrupted
table resumes and runners of different seeds, side by side, share it;
the mean +- std over seeds per method and split) and <out>/dcfm[_<dataset>]_grid.png (DCFM-B, non-IID, first
seed: digit x colour, novel cells framed in white); with --doc PAGE.md, the same table as markdown in the
page's generated block (experiments.common.write_block). The distances are on
SmallCNN features (digit + colour reference classifiers trained on the server's real data), NOT Inception.

Beside the figures (experiments.common): per split a convergence verdict, converged when every seed's
FedFlow (one velocity net on every client's pairs: the table's oracle-like reference) has a seen-pair
composition accuracy >= 90% (its samples of the pairs it trained on read as the requested digit and
colour); every row of the split prints it. Paired seeds: DCFM-A and DCFM-B against FedFlow and against
DDM, per split, on novel Frechet distance (lower is better) and novel composition accuracy (higher is).
Compute per row (flow_compute): optimiser steps of every net its samples need and images seen = steps x
batch-size. Runs go through fedapp.simulation.simulate_in_process (default; --backend ray: fedapp.simulate)
with --threads torch threads (default: the cores available); in-process, a (seed, split)'s rows share one
ReplyCache, so DCFM-B reuses DCFM-A's Stage-I experts and local-only-flow DDM's (the same plain Stage I;
`client_calls_reused` per row) instead of training them again; the cache keeps them on disk under
<runs>/reply-cache, so a table resumed later does not train them again either.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from experiments.cli import common_args, pin_threads
from experiments.common import (BACKENDS, all_converged, available_cpus, check_configs, count_text, file_lock,
                                generative_verdict, kid_cell, over_seeds, paired_difference, paired_text, parse_set,
                                prog, run, subset_of, verdict_mark, write_block)
from fedapp.results import atomic_write_json

# (row, its run-config keys): a row's method is its name, "dcfm" for the dcfm-* rows, or its own "method" key
ROWS = [("fedflow", {}), ("ddm", {}), ("ddm+l", {"method": "ddm", "dcfm.ddm-ci": True}), ("local-only-flow", {}),
        ("dcfm-a", {"dcfm.variant": "a", "dcfm.peer-schedule": "sequential"}),
        ("dcfm-a-allgather", {"dcfm.variant": "a", "dcfm.peer-schedule": "allgather"}),
        ("dcfm-b", {"dcfm.variant": "b"})]
ROW_NAMES = [n for n, _ in ROWS]
SPLITS = ("non-iid", "iid")  # the paper's headline column first
# the paper's rows under our names: its DDM row is DDM+L, its DCFM-A runs the allgather
PAPER_NONIID_NOVEL_FID = {"fedflow": 20.02, "ddm+l": 18.84, "dcfm-a-allgather": 9.29, "dcfm-b": 9.15}

# Sized for ~25 min of one shared CPU core (the paper: 10 clients, 28x28 MNIST, full training).
SETTINGS = {"image-size": 8, "batch-size": 32, "num-server-rounds": 4, "dcfm.fl-local-steps": 25,
            "dcfm.local-steps": 100, "dcfm.peer-steps": 30, "dcfm.rounds": 2, "dcfm.distill-steps": 200,
            "dcfm.replay-paths": 96, "dcfm.path-steps": 8, "dcfm.sample-steps": 12, "dcfm.samples-per-pair": 6,
            "dcfm.width": 16, "dcfm.router-steps": 100, "dcfm.ref-epochs": 3}
QUICK = {**SETTINGS, "num-server-rounds": 2, "dcfm.fl-local-steps": 5, "dcfm.local-steps": 10, "dcfm.peer-steps": 5,
         "dcfm.rounds": 1, "dcfm.distill-steps": 10, "dcfm.replay-paths": 16, "dcfm.samples-per-pair": 2,
         "dcfm.router-steps": 10, "dcfm.ref-epochs": 1}


def base_row(name: str) -> str:
    """The table row a sweep row varies: "dcfm-b@dcfm.distill-steps=500" -> "dcfm-b"."""
    return name.split("@")[0]


def sweep_rows(rows: list[tuple[str, dict]], sweep: str | None) -> list[tuple[str, dict]]:
    """`rows`, or with --sweep KEY=V1,V2,..: each row once per value, named "<row>@KEY=<value>", the value typed
    as --set types it."""
    if not sweep:
        return rows
    key, _, values = sweep.partition("=")
    if not key or not values:
        raise SystemExit(f"--sweep={sweep!r}: must be KEY=V1,V2,... (e.g. dcfm.distill-steps=500,1000)")
    return [(f"{name}@{key}={v}", {**extra, **parse_set([f"{key}={v}"])}) for name, extra in rows
            for v in values.split(",")]


def config(name: str, extra: dict, split: str, clients: int, settings: dict, out_dir: str, seed: int = 0) -> dict:
    method = "dcfm" if base_row(name).startswith("dcfm") else base_row(name)
    return {"method": method, "partitioner": "attribute-holdout", "seed": seed,
            "partitioner.per-class": 0, "partitioner.coverage": 0.5, "partitioner.split": split, "min-clients": clients,
            "out-dir": out_dir, "run-name": f"{name}-{split}" + (f"-seed{seed}" if seed else ""), **settings, **extra}


FIGURE_KEYS = ("seen_distance", "novel_distance", "seen_kid", "seen_kid_std", "novel_kid", "novel_kid_std",
               "seen_composition_accuracy", "novel_composition_accuracy", "seen_digit_accuracy",
               "novel_digit_accuracy", "seen_color_accuracy", "novel_color_accuracy", "model_transfers_per_client")
# fedapp.readers; DCFM's composites against its joint fields (strategies.dcfm.DcfmStrategy.ci_diagnostics), A's
# schedule and the same per peer round with the experts' gauge figures (DcfmStrategy.round_record); DDM's router
# on the asked pair's holders (strategies.fedflow.router_holder_weight)
OPTIONAL_KEYS = ("reader_accuracy", "reader_unreliable", "ci_residual_self", "ci_residual_mixture",
                 "peer_schedule", "ci_by_round", "router_holder_weight", "router_holder_weight_end")


def row_figures(metrics: dict) -> dict:
    """A run's figures that its table row keeps: every row's, and those only some methods report."""
    return {**{k: metrics[k] for k in FIGURE_KEYS}, **{k: metrics[k] for k in OPTIONAL_KEYS if k in metrics}}


def run_one(name: str, extra: dict, split: str, clients: int, settings: dict, out_dir: str, backend: str,
            seed: int = 0, cache: Any = None) -> dict:
    """One (row, split, seed) run; `cache` (a ReplyCache, in-process only) is shared by a (seed, split)'s rows,
    so that DCFM-B reuses DCFM-A's Stage I (the same train messages: fedapp.registry's DCFM server-only keys)."""
    t0 = time.time()
    hits = cache.hits if cache is not None else 0
    s = run(config(name, extra, split, clients, settings, out_dir, seed), clients, backend, reply_cache=cache)
    return {"method": name, "split": split, "seed": seed, **row_figures(s["metrics"]),
            "seconds": round(time.time() - t0, 1),
            "client_calls_reused": (cache.hits - hits) if cache is not None else 0,
            "run_dir": s["run_dir"], "model_transfers_recounted": transfers_from_run(s["run_dir"])}


def transfers_from_run(run_dir: str) -> float:
    """Model transfers per client recounted from the run's comm.json: (bytes up + down - the run config
    riding on each message down) / the serialised size of one velocity net, as the run measured it
    (summary.json's `model_bytes`, the size the MeteredGrid's count is divided by)."""
    from flwr.app import ConfigRecord, RecordDict

    from fedapp.protocols import RUN_KEY
    from fedapp.protocols.records import record_nbytes

    run = Path(run_dir)
    model = json.loads((run / "summary.json").read_text())["metrics"]["model_bytes"]
    cfg_bytes = record_nbytes(RecordDict({RUN_KEY: ConfigRecord(json.loads((run / "config.json").read_text()))}))
    per = json.loads((run / "comm.json").read_text())["totals"]["per_client"]
    vals = [(r["up_bytes"] + r["down_bytes"] - r["messages_down"] * cfg_bytes) / model for r in per.values()]
    return round(sum(vals) / len(vals), 3)


def flow_compute(name: str, settings: dict, clients: int, extra: dict | None = None) -> dict[str, int]:
    """A row's optimiser steps, summed over the nets its samples need, and images seen = steps x batch-size
    (every trainer draws batch-size a step; the router's and the student's are generated, not real):
    fedflow clients x num-server-rounds x dcfm.fl-local-steps; local-only-flow clients x dcfm.local-steps
    (Stage I); ddm (and ddm+l) Stage I + dcfm.router-steps; DCFM-A (either schedule) Stage I + clients x
    dcfm.rounds x dcfm.peer-steps; DCFM-B Stage I + dcfm.distill-steps. Not counted: the reference
    classifiers (evaluation only)."""
    from fedapp.config import parse_run_config

    cfg = parse_run_config(config(name, dict(ROWS)[base_row(name)] if extra is None else extra, SPLITS[0], clients,
                                  settings, "runs"))
    o = cfg.options
    stage_one = clients * o.local_steps
    kind = f"dcfm-{o.variant}" if cfg.method == "dcfm" else cfg.method
    steps = {"fedflow": clients * cfg.num_server_rounds * o.fl_local_steps, "local-only-flow": stage_one,
             "ddm": stage_one + o.router_steps, "dcfm-a": stage_one + clients * o.rounds * o.peer_steps,
             "dcfm-b": stage_one + o.distill_steps}[kind]
    return {"steps": steps, "images_seen": steps * cfg.batch_size}


def split_verdicts(rows: list[dict]) -> dict[str, dict]:
    """Per split: converged when every seed's FedFlow reads >= 90% of its seen-pair samples as the
    requested (digit, colour) pair (experiments.common.generative_verdict)."""
    return {split: all_converged([generative_verdict(r.get("seen_composition_accuracy")) for r in rows
                                  if r["method"] == "fedflow" and r["split"] == split]) for split in SPLITS}


PAIRED = (("novel_distance", False), ("novel_composition_accuracy", True))  # (figure, higher is better)
# (row, reference): each DCFM row against the baselines, and the paper's own A and DDM+L against ours
COMPARED = [(m, ref) for m in ("dcfm-a", "dcfm-a-allgather", "dcfm-b") for ref in ("fedflow", "ddm", "ddm+l")]
COMPARED += [("dcfm-a-allgather", "dcfm-a"), ("ddm+l", "ddm")]


def paired_rows(rows: list[dict]) -> list[dict]:
    """COMPARED, per split, on the seeds both rows have (experiments.common.paired_difference)."""
    def per_seed(method: str, split: str, key: str) -> dict:
        return {r.get("seed", 0): r.get(key) for r in rows if r["method"] == method and r["split"] == split}

    return [{"method": m, "against": ref, "split": split,
             **{k: paired_difference(per_seed(m, split, k), per_seed(ref, split, k), higher) for k, higher in PAIRED}}
            for split in SPLITS for m, ref in COMPARED
            if per_seed(m, split, PAIRED[0][0]) and per_seed(ref, split, PAIRED[0][0])]


def table(rows: list[dict], compute: dict[str, dict] | None = None, verdicts: dict[str, dict] | None = None) -> str:
    """One line per run with its row's steps and images seen (flow_compute) and its split's verdict."""
    compute, verdicts = compute or {}, verdicts or split_verdicts(rows)
    w = max([16] + [len(r["method"]) + 2 for r in rows])  # a sweep row's name is longer than the table's
    head = (f"{'method':<{w}}{'split':<9}{'seed':>5}{'FD seen':>9}{'FD novel':>10}{'KID seen':>19}{'KID novel':>19}"
            f"{'acc seen':>10}{'acc novel':>10}{'transfers':>11}{'steps':>9}{'images seen':>13}  verdict")
    lines = [head, "-" * len(head)]
    for r in rows:
        c = compute.get(r["method"], {})
        lines.append(f"{r['method']:<{w}}{r['split']:<9}{r.get('seed', 0):>5}"
                     f"{r['seen_distance']:>9.2f}{r['novel_distance']:>10.2f}"
                     f"{kid_cell(r, 'seen_kid'):>19}{kid_cell(r, 'novel_kid'):>19}"
                     f"{r['seen_composition_accuracy']:>10.3f}{r['novel_composition_accuracy']:>10.3f}"
                     f"{r['model_transfers_per_client']:>11.2f}{count_text(c.get('steps')):>9}"
                     f"{count_text(c.get('images_seen')):>13}  {verdict_mark(verdicts.get(r['split'])) or 'converged'}")
    return "\n".join(lines)


def paired_table(paired: list[dict]) -> str:
    """"+1.2 ± 0.8 (3/3)" per comparison: row - reference, (seeds favouring the row / seeds paired)."""
    head = f"{'same seeds: row - reference':<30}{'split':<9}{'FD novel':>22}{'acc novel':>22}"
    lines = [head, "-" * len(head)]
    for q in paired:
        lines.append(f"{q['method'] + ' - ' + q['against']:<30}{q['split']:<9}"
                     f"{paired_text(q['novel_distance'], 2):>22}{paired_text(q['novel_composition_accuracy'], 3):>22}")
    return "\n".join(lines)


def pct(r: dict, key: str) -> str:
    return f"{100 * r[key]:.1f}" if isinstance(r.get(key), (int, float)) else "n/a"


def mean_pct(m: dict, key: str) -> str:
    """"34.8 ± 1.2" (percent, mean ± std over seeds) from a summarise() row."""
    return f"{100 * m[key]:.1f} ± {100 * m[key + '_seed_std']:.1f}" if key in m else "n/a"


def mean_num(m: dict, key: str) -> str:
    return f"{m[key]:,.0f} ± {m[key + '_seed_std']:,.0f}" if key in m else "n/a"


def seconds_text(r: dict) -> str:
    """The run's wall time, and how many client calls it took from the reply cache instead of running them."""
    reused = r.get("client_calls_reused") or 0
    return f"{r.get('seconds', 0):,.0f}" + (f" ({reused} client calls cached)" if reused else "")


def kid_text(r: dict) -> str:
    """KID ± its std over subsets, as the json keeps it (fedapp.metrics.kernel_distance)."""
    return f"{r['novel_kid']:,.0f} ± {r['novel_kid_std']:,.0f}" if "novel_kid" in r else "n/a"


def run_order(r: dict) -> tuple[int, int, int]:
    """A run's place in the table: by split, then row (a sweep row after the table's), then seed."""
    method = ROW_NAMES.index(r["method"]) if r["method"] in ROW_NAMES else len(ROW_NAMES)
    return SPLITS.index(r["split"]) if r["split"] in SPLITS else len(SPLITS), method, r.get("seed", 0)


def markdown(done: dict) -> str:
    """The table json as markdown for docs/ (--doc): each run, the mean ± std over seeds per (split, method)
    with its split's verdict, and the same-seed differences of A and B against FedFlow and DDM."""
    runs = sorted(done["rows"], key=run_order)
    lines = ["Each run (accuracies in %: the digit and colour readers' reading of the samples; a pair is right when "
             "both are):", "",
             "| split | method | seed | seen pairs | novel pairs | digit seen / novel | colour seen / novel "
             "| FD seen / novel | KID novel | transfers a client | seconds |", "|" + "---|" * 11]
    for r in runs:
        lines.append(f"| {r['split']} | {r['method']} | {r.get('seed', 0)} | {pct(r, 'seen_composition_accuracy')} "
                     f"| {pct(r, 'novel_composition_accuracy')} "
                     f"| {pct(r, 'seen_digit_accuracy')} / {pct(r, 'novel_digit_accuracy')} "
                     f"| {pct(r, 'seen_color_accuracy')} / {pct(r, 'novel_color_accuracy')} "
                     f"| {r['seen_distance']:,.0f} / {r['novel_distance']:,.0f} | {kid_text(r)} "
                     f"| {r['model_transfers_per_client']:.1f} | {seconds_text(r)} |")
    lines += ["", "Mean ± std over seeds (FD: Fréchet distance on the readers' features, lower is better):", "",
              "| split | method | seeds | seen pairs | novel pairs | novel digit | novel colour | FD seen | FD novel "
              "| steps | split verdict |", "|" + "---|" * 11]
    for m in done.get("mean_over_seeds", []):
        lines.append(f"| {m['split']} | {m['method']} | {','.join(map(str, m['seeds']))} "
                     f"| {mean_pct(m, 'seen_composition_accuracy')} | {mean_pct(m, 'novel_composition_accuracy')} "
                     f"| {mean_pct(m, 'novel_digit_accuracy')} | {mean_pct(m, 'novel_color_accuracy')} "
                     f"| {mean_num(m, 'seen_distance')} | {mean_num(m, 'novel_distance')} "
                     f"| {count_text(m.get('steps'))} | {verdict_mark(m['verdict']) or 'converged'} |")
    if done.get("paired"):
        lines += ["", "Same seeds, row − reference: mean ± std (seeds favouring the row / seeds paired):", "",
                  "| split | row − reference | novel FD | novel pairs (points) |", "|---|---|---|---|"]
        for q in done["paired"]:
            lines.append(f"| {q['split']} | {q['method']} − {q['against']} | {paired_text(q['novel_distance'], 0)} "
                         f"| {paired_text(q['novel_composition_accuracy'], 1, scale=100)} |")
    return "\n".join(lines + rounds_lines(runs))


def rounds_lines(runs: list[dict]) -> list[str]:
    """The per-round record of the A runs that keep one (`ci_by_round`) as markdown: round 0 is Stage I."""
    traced = [r for r in runs if r.get("ci_by_round")]
    if not traced:
        return []
    lines = ["", "DCFM-A after Stage I (round 0) and each peer round, on noised real images of seen pairs. Residuals: "
             "composite against joint field, relative to the conditional signal. Gauge: the experts' unconditional "
             "fields apart, moved in the round, and from where their peers stood at its start, relative to their "
             "size:", "", "| split | method | seed | round | residual own / mixture | gauge gap | moved "
             "| to peers' start |", "|" + "---|" * 8]

    def num(rec: dict, key: str) -> str:
        return f"{rec[key]:.3f}" if isinstance(rec.get(key), (int, float)) else ""

    for r in traced:
        for rec in r["ci_by_round"]:
            lines.append(f"| {r['split']} | {r['method']} | {r.get('seed', 0)} | {rec['round']} "
                         f"| {num(rec, 'ci_residual_self')} / {num(rec, 'ci_residual_mixture')} "
                         f"| {num(rec, 'uncond_gap')} | {num(rec, 'uncond_moved')} | {num(rec, 'uncond_to_peers')} |")
    return lines


MEAN_KEYS = ("seen_distance", "novel_distance", "seen_kid", "novel_kid", "seen_composition_accuracy",
             "novel_composition_accuracy", "novel_digit_accuracy", "novel_color_accuracy", "model_transfers_recounted")


def summarise(rows: list[dict], compute: dict[str, dict] | None = None) -> list[dict]:
    """Per (method, split): the mean and std over seeds of MEAN_KEYS (common.over_seeds), the seeds, the
    split's verdict and the row's compute (flow_compute, when given)."""
    out, verdicts = [], split_verdicts(rows)
    names = ROW_NAMES + list(dict.fromkeys(r["method"] for r in rows if r["method"] not in ROW_NAMES))  # sweeps
    for name in names:
        for split in SPLITS:
            mine = [r for r in rows if r["method"] == name and r["split"] == split]
            if mine:
                out.append({"method": name, "split": split, "seeds": sorted(r.get("seed", 0) for r in mine),
                            **over_seeds(mine, MEAN_KEYS), "verdict": verdicts[split], **(compute or {}).get(name, {})})
    return out


def copy_grids(rows: list[dict], folder: Path, stem: str) -> list[Path]:
    """Each table method's digit x colour sample grid (novel pairs framed in white) of its first seed on the
    non-IID split, the paper's headline column, as <stem>_grid_<method>.png; DCFM-B's also as <stem>_grid.png.
    A sweep's rows are not the table's: none copied."""
    copied = []
    for name, _ in ROWS:
        mine = sorted((r for r in rows if r["method"] == name and r["split"] == "non-iid"),
                      key=lambda r: r.get("seed", 0))
        src = Path(mine[0]["run_dir"]) / "images" / "grid.png" if mine else None
        if src is None or not src.is_file():
            continue
        targets = [folder / f"{stem}_grid_{name}.png"] + ([folder / f"{stem}_grid.png"] if name == "dcfm-b" else [])
        for dst in targets:
            shutil.copy(src, dst)
            copied.append(dst)
    return copied


def write_views(path: Path, done: dict, compute: dict[str, dict]) -> None:
    """The json after every run: the runs, their means over seeds, the verdicts and the paired differences."""
    done.update(mean_over_seeds=summarise(done["rows"], compute), verdicts=split_verdicts(done["rows"]),
                paired=paired_rows(done["rows"]), compute=compute)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, done)


def on_disk(path: Path, settings: dict, clients: int) -> dict:
    """The table json at `path` when it was written under the same settings and clients; else a fresh one."""
    done = json.loads(path.read_text()) if path.exists() else {}
    if done.get("settings") != settings or done.get("clients") != clients:
        done = {"settings": settings, "clients": clients, "rows": []}
    done["paper_noniid_novel_fid"] = PAPER_NONIID_NOVEL_FID
    return done


def cell(r: dict) -> tuple[str, str, int]:
    return r["method"], r["split"], r.get("seed", 0)


def record_row(path: Path, row: dict | None, settings: dict, clients: int, compute: dict[str, dict]) -> dict:
    """Adds one finished run (None: none, the views only) to the json under a lock, merged with the rows another
    runner (other seeds, the same settings) wrote meanwhile, so two runners side by side never overwrite each
    other's cells; returns the merged json."""
    with file_lock(path):
        done = on_disk(path, settings, clients)
        if row is not None:
            done["rows"] = [r for r in done["rows"] if cell(r) != cell(row)] + [row]
        write_views(path, done, {**done.get("compute", {}), **compute})
    return done


def parser() -> argparse.ArgumentParser:
    shared = common_args(
        dataset="colored-digits", seeds="0", set=[], out="docs/results", runs="runs/dcfm-table",
        threads=available_cpus(),
        helps={"dataset": "digit x colour data (colored-mnist: real digits)",
               "seeds": "comma-separated run seeds; each (method, split) runs once per seed",
               "set": "run-config overrides on top of the table's settings (e.g. dcfm.local-steps=200)",
               "out": "folder for dcfm[_<dataset>].json and its grid",
               "threads": "torch threads of this process and the processes it starts (clients and server phases "
                          "alike; default: the cores available; 0: torch's default)"})
    p = argparse.ArgumentParser(prog=prog("dcfm"), description=__doc__.split("\n")[0], parents=[shared])
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="a smoke run (minutes), not the table")
    p.add_argument("--image-size", type=int, default=0, help="0: the table's setting (8)")
    p.add_argument("--rows", default=",".join(ROW_NAMES), help="subset of the table's rows")
    p.add_argument("--splits", default=",".join(SPLITS), help=f"subset of {','.join(SPLITS)}")
    p.add_argument("--sweep", default=None, metavar="KEY=V1,V2,...",
                   help="run each of --rows once per value of one run-config key (a budget sweep; its own json)")
    p.add_argument("--doc", default=None, metavar="PAGE.md",
                   help="also write the table as markdown into this page (its generated block dcfm:<stem>)")
    p.add_argument("--backend", choices=BACKENDS, default="inprocess",
                   help="inprocess: fedapp.simulation.simulate_in_process (no Ray start-up); ray: fedapp.simulate")
    return p


def main(argv: list[str]) -> None:
    a = parser().parse_args(argv)
    pin_threads(a.threads)
    settings = {**(QUICK if a.quick else SETTINGS), "dataset": a.dataset}
    if a.image_size:
        settings["image-size"] = a.image_size
    settings.update(parse_set(a.set))
    seeds = [int(x) for x in a.seeds.split(",") if x]
    splits, names = subset_of("splits", a.splits, SPLITS), subset_of("rows", a.rows, ROW_NAMES)
    rows = sweep_rows([(n, e) for n, e in ROWS if n in names], a.sweep)
    check_configs([config(n, e, s, a.clients, settings, a.runs) for s in splits for n, e in rows], a.clients)
    stem = "dcfm" if a.dataset == "colored-digits" else f"dcfm_{a.dataset}"
    if a.sweep:  # a sweep's rows are not the table's: their own json
        stem += f"_sweep_{a.sweep.partition('=')[0]}"
    out = Path(a.out) / f"{stem}.json"
    # this invocation's rows; those of earlier ones (other --rows or sweep values) stay in the json (record_row)
    compute = {n: flow_compute(n, settings, a.clients, e) for n, e in rows}
    from fedapp.simulation import ReplyCache

    for seed in seeds:
        for split in splits:
            # kept on disk too (<runs>/reply-cache): a table cut between DCFM-A and DCFM-B trains Stage I once
            cache = ReplyCache(Path(a.runs) / "reply-cache") if a.backend == "inprocess" else None
            for name, extra in rows:
                if (name, split, seed) in {cell(r) for r in on_disk(out, settings, a.clients)["rows"]}:
                    continue  # run before, or meanwhile by another runner
                row = run_one(name, extra, split, a.clients, settings, a.runs, a.backend, seed, cache)
                done = record_row(out, row, settings, a.clients, compute)
                print(table(done["rows"], done["compute"]), flush=True)
    done = record_row(out, None, settings, a.clients, compute)
    copy_grids(done["rows"], out.parent, stem)
    if a.doc:
        write_block(Path(a.doc), f"dcfm:{stem}", markdown(done))
    print(table(done["rows"], done["compute"]))
    if done["paired"]:
        print(f"\n{paired_table(done['paired'])}")
