"""DCFM's Colored-MNIST-style table on colored-digits: Frechet distance on reference-classifier features
and composition accuracy, seen vs novel (digit, colour) pairs, IID vs non-IID, for fedflow, ddm,
local-only-flow, DCFM-A and DCFM-B.

    python -m experiments dcfm [--clients 5] [--seeds 0,1,2] [--quick] [--out docs]

Writes <out>/dcfm[_<dataset>].json (one row per run, written after each run so an interrupted table resumes;
the mean +- std over seeds per method and split) and <out>/dcfm[_<dataset>]_grid.png (DCFM-B, non-IID, first
seed: digit x colour, novel cells framed in white). The distances are on
SmallCNN features (digit + colour reference classifiers trained on the server's real data), NOT Inception.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from experiments.common import BACKENDS, check_configs, kid_cell, over_seeds, parse_set, prog, run
from fedapp.results import atomic_write_json

ROWS = [("fedflow", {}), ("ddm", {}), ("local-only-flow", {}),
        ("dcfm-a", {"dcfm.variant": "a"}), ("dcfm-b", {"dcfm.variant": "b"})]
SPLITS = ("non-iid", "iid")  # the paper's headline column first
PAPER_NONIID_NOVEL_FID = {"fedflow": 20.02, "ddm": 18.84, "dcfm-a": 9.29, "dcfm-b": 9.15}

# Sized for ~25 min of one shared CPU core (the paper: 10 clients, 28x28 MNIST, full training).
SETTINGS = {"image-size": 8, "batch-size": 32, "num-server-rounds": 4, "dcfm.fl-local-steps": 25,
            "dcfm.local-steps": 100, "dcfm.peer-steps": 30, "dcfm.rounds": 2, "dcfm.distill-steps": 200,
            "dcfm.replay-paths": 96, "dcfm.path-steps": 8, "dcfm.sample-steps": 12, "dcfm.samples-per-pair": 6,
            "dcfm.width": 16, "dcfm.router-steps": 100, "dcfm.ref-epochs": 3}
QUICK = {**SETTINGS, "num-server-rounds": 2, "dcfm.fl-local-steps": 5, "dcfm.local-steps": 10, "dcfm.peer-steps": 5,
         "dcfm.rounds": 1, "dcfm.distill-steps": 10, "dcfm.replay-paths": 16, "dcfm.samples-per-pair": 2,
         "dcfm.router-steps": 10, "dcfm.ref-epochs": 1}


def config(name: str, extra: dict, split: str, clients: int, settings: dict, out_dir: str, seed: int = 0) -> dict:
    method = "dcfm" if name.startswith("dcfm") else name
    return {"method": method, "partitioner": "attribute-holdout", "seed": seed,
            "partitioner.per-class": 0, "partitioner.coverage": 0.5, "partitioner.split": split, "min-clients": clients,
            "out-dir": out_dir, "run-name": f"{name}-{split}" + (f"-seed{seed}" if seed else ""), **settings, **extra}


def run_one(name: str, extra: dict, split: str, clients: int, settings: dict, out_dir: str, backend: str,
            seed: int = 0) -> dict:
    t0 = time.time()
    s = run(config(name, extra, split, clients, settings, out_dir, seed), clients, backend)
    m = s["metrics"]
    keys = ("seen_distance", "novel_distance", "seen_kid", "seen_kid_std", "novel_kid", "novel_kid_std",
            "seen_composition_accuracy", "novel_composition_accuracy",
            "seen_digit_accuracy", "novel_digit_accuracy", "seen_color_accuracy", "novel_color_accuracy",
            "model_transfers_per_client")
    return {"method": name, "split": split, "seed": seed, **{k: m[k] for k in keys},
            "seconds": round(time.time() - t0, 1),
            "run_dir": s["run_dir"], "model_transfers_recounted": transfers_from_run(s["run_dir"])}


def transfers_from_run(run_dir: str) -> float:
    """Model transfers per client recounted from the run's comm.json: (bytes up + down - the run config
    riding on each message down) / the serialised size of one velocity net (what the MeteredGrid counts)."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    from fedapp.models.compose import build_velocity
    from fedapp.protocols import RUN_KEY
    from fedapp.protocols.dcfm import EXPERT_KEY
    from fedapp.protocols.records import record_nbytes

    run = Path(run_dir)
    cfg = json.loads((run / "config.json").read_text())
    torch.manual_seed(0)
    net = build_velocity(cfg["image-size"], [10, 6], cfg["dcfm.width"])
    model = record_nbytes(RecordDict({EXPERT_KEY: ArrayRecord(net.state_dict())}))
    cfg_bytes = record_nbytes(RecordDict({RUN_KEY: ConfigRecord(cfg)}))
    per = json.loads((run / "comm.json").read_text())["totals"]["per_client"]
    vals = [(r["up_bytes"] + r["down_bytes"] - r["messages_down"] * cfg_bytes) / model for r in per.values()]
    return round(sum(vals) / len(vals), 3)


def table(rows: list[dict]) -> str:
    head = (f"{'method':<16}{'split':<9}{'seed':>5}{'FD seen':>9}{'FD novel':>10}{'KID seen':>16}{'KID novel':>16}"
            f"{'acc seen':>10}{'acc novel':>10}{'transfers':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['method']:<16}{r['split']:<9}{r.get('seed', 0):>5}{r['seen_distance']:>9.2f}{r['novel_distance']:>10.2f}"
                     f"{kid_cell(r, 'seen_kid'):>16}{kid_cell(r, 'novel_kid'):>16}"
                     f"{r['seen_composition_accuracy']:>10.3f}{r['novel_composition_accuracy']:>10.3f}"
                     f"{r['model_transfers_per_client']:>11.2f}")
    return "\n".join(lines)


MEAN_KEYS = ("seen_distance", "novel_distance", "seen_kid", "novel_kid", "seen_composition_accuracy",
             "novel_composition_accuracy", "novel_digit_accuracy", "novel_color_accuracy", "model_transfers_recounted")


def summarise(rows: list[dict]) -> list[dict]:
    """Per (method, split): the mean and std over seeds of MEAN_KEYS (common.over_seeds), and the seeds."""
    out = []
    for name, _ in ROWS:
        for split in SPLITS:
            mine = [r for r in rows if r["method"] == name and r["split"] == split]
            if mine:
                out.append({"method": name, "split": split, "seeds": sorted(r.get("seed", 0) for r in mine),
                            **over_seeds(mine, MEAN_KEYS)})
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog=prog("dcfm"), description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--seeds", default="0", help="comma-separated run seeds; each (method, split) runs once per seed")
    p.add_argument("--quick", action="store_true", help="a smoke run (minutes), not the table")
    p.add_argument("--dataset", default="colored-digits", help="digit x colour data (colored-mnist: real digits)")
    p.add_argument("--image-size", type=int, default=0, help="0: the table's setting (8)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="run-config overrides on top of the table's settings (e.g. dcfm.local-steps=200)")
    p.add_argument("--out", default="docs", help="folder for dcfm[_<dataset>].json and its grid")
    p.add_argument("--runs", default="runs/dcfm-table", help="folder of the runs' own folders")
    p.add_argument("--backend", choices=BACKENDS, default="ray",
                   help="ray: fedapp.simulate; inprocess: fedapp.simulation.simulate_in_process (no Ray start-up)")
    a = p.parse_args(argv)
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    settings = {**(QUICK if a.quick else SETTINGS), "dataset": a.dataset}
    if a.image_size:
        settings["image-size"] = a.image_size
    settings.update(parse_set(a.set))
    seeds = [int(x) for x in a.seeds.split(",") if x]
    check_configs([config(n, e, s, a.clients, settings, a.runs) for s in SPLITS for n, e in ROWS], a.clients)
    stem = "dcfm" if a.dataset == "colored-digits" else f"dcfm_{a.dataset}"
    out = Path(a.out) / f"{stem}.json"
    done = json.loads(out.read_text()) if out.exists() else {}
    if done.get("settings") != settings or done.get("clients") != a.clients:
        done = {"settings": settings, "clients": a.clients, "rows": []}
    have = {(r["method"], r["split"], r.get("seed", 0)) for r in done["rows"]}
    for seed in seeds:
        for split in SPLITS:
            for name, extra in ROWS:
                if (name, split, seed) in have:
                    continue
                done["rows"].append(run_one(name, extra, split, a.clients, settings, a.runs, a.backend, seed))
                done["mean_over_seeds"] = summarise(done["rows"])
                out.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(out, done)
                print(table(done["rows"]), flush=True)
    done["paper_noniid_novel_fid"] = PAPER_NONIID_NOVEL_FID
    done["mean_over_seeds"] = summarise(done["rows"])
    atomic_write_json(out, done)
    grid = sorted((r for r in done["rows"] if r["method"] == "dcfm-b" and r["split"] == "non-iid"),
                  key=lambda r: r.get("seed", 0))
    if grid:
        shutil.copy(Path(grid[0]["run_dir"]) / "images" / "grid.png", out.with_name(f"{stem}_grid.png"))
    print(table(done["rows"]))
