"""The default run's accuracy with the server sampler in float32 and under bf16 autocast, same seeds.

    python benchmarks/precision_accuracy.py [--seeds 0,1,2] [--threads 1] [--out docs/results/precision_accuracy.json]

Per seed: the default experiment (Espresso on digit-styles, 4 clients) with `espresso.precision=fp32`, then
with `bf16`; the clients' uploads are computed once and shared (fedapp.simulation.ReplyCache: precision is a
server-only key), so the two runs differ only in the synthesis and what the classifier learns from it.
Prints and writes each seed's accuracies and the paired difference (bf16 - fp32, points). A seed's finished
pair is kept in the json and skipped when the command runs again. One seed is ~20 min of one thread.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.cli import common_args, pin_threads  # noqa: E402

PRECISIONS = ("fp32", "bf16")


def paired(results: dict) -> dict:
    """Mean and std (over seeds with both runs) of bf16 - fp32 in points, and the seeds where bf16 is lower."""
    import numpy as np

    seeds = sorted(s for s, r in results.items() if all(p in r for p in PRECISIONS))
    diffs = np.array([100 * (results[s]["bf16"] - results[s]["fp32"]) for s in seeds])
    return {"seeds": seeds, "mean_points": float(diffs.mean()) if len(diffs) else None,
            "std_points": float(diffs.std(ddof=1)) if len(diffs) > 1 else None,
            "bf16_lower": int((diffs < 0).sum())}


def main(argv: list[str] | None = None) -> dict:
    shared = common_args(seeds="0,1,2", threads=1, out="docs/results/precision_accuracy.json",
                         helps={"out": "the JSON file of the accuracies and their paired difference"})
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[shared])
    a = ap.parse_args(argv)
    pin_threads(a.threads)
    from fedapp.results import atomic_write_json
    from fedapp.simulation import ReplyCache, simulate_in_process

    out = Path(a.out)
    results = json.loads(out.read_text())["accuracy"] if out.is_file() else {}
    with tempfile.TemporaryDirectory() as runs:
        for seed in a.seeds.split(","):
            cache, row = ReplyCache(), results.setdefault(seed, {})
            for p in PRECISIONS:
                if p not in row:
                    s = simulate_in_process({"seed": int(seed), "espresso.precision": p, "out-dir": runs,
                                             "run-name": f"{p}-s{seed}"}, 4, reply_cache=cache)
                    row[p] = s["metrics"]["accuracy"]
                    atomic_write_json(out, {"accuracy": results, "bf16_minus_fp32": paired(results)})
            print(f"seed {seed}: fp32 {row['fp32']:.4f}  bf16 {row['bf16']:.4f}", flush=True)
    summary = {"accuracy": results, "bf16_minus_fp32": paired(results)}
    atomic_write_json(out, summary)
    print(f"bf16 - fp32: {summary['bf16_minus_fp32']}")
    return summary


if __name__ == "__main__":
    main()
