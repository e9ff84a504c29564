"""The plan's projection (`python -m fedapp.plan`) against a measured run on this machine.

    python benchmarks/plan_check.py [--threads 1] [--clients 4] [--cases espresso fedavg]

Each case is planned (counts, bytes, the micro-benchmark of its modules), then run in this process
(fedapp.simulation.simulate_in_process: the clients one after another, as the plan's "wall in process"
assumes), then planned again: the projection is the mean of the two plans' (the machine's load may drift
while the run goes on). Printed per case: measured and projected seconds and their ratio, the run's
phases beside the plan's matching terms, and bytes down and up measured (comm.json's totals) against
counted. A case passes when its time ratio is within [1/1.5, 1.5] and its bytes within 1 %.

Cases: `espresso` is the default experiment (Espresso on digit-styles, 4 clients of 16 images per class)
with the sampler, condition learning, synthesis ratio and server epochs cut to take a minute or two;
`fedavg` the default FedAvg run (5 rounds, 3 local epochs).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.cli import common_args, pin_threads  # noqa: E402

CASES = {
    "espresso": {"method": "espresso", "espresso.steps": 4, "espresso.embed-steps": 15, "espresso.ratio": 1.5,
                 "server-epochs": 5},
    "fedavg": {"method": "fedavg"},
}
# run phase -> the plan terms whose seconds it holds (by the start of their `what`)
PHASES = {"espresso": {"train": ("client:",), "synthesis": ("server: synthesis", "server: decode"),
                       "classifier": ("server classifier",), "evaluate": ("client evaluation",)},
          "fedavg": {"train": ("local SGD",), "evaluate": ("client evaluation",)}}
TOLERANCE = 1.5


def projected_phases(plan: dict, case: str) -> dict[str, float]:
    return {phase: sum(t["seconds"] for t in plan["terms"] if t["what"].startswith(prefixes))
            for phase, prefixes in PHASES.get(case, {}).items()}


def check(case: str, flat: dict, clients: int) -> dict:
    from fedapp.plan import make_plan
    from fedapp.simulation import simulate_in_process

    with tempfile.TemporaryDirectory() as out:
        flat = {**flat, "out-dir": out, "run-name": f"plan-check-{case}"}  # the run config the messages carry
        before = make_plan(flat, clients)
        t0 = time.perf_counter()
        summary = simulate_in_process(flat, clients)
        measured = time.perf_counter() - t0
        after = make_plan(flat, clients)
    plans = (before, after)
    projected = sum(p["totals"]["wall_seconds_in_process"] for p in plans) / 2
    phases = {k: sum(projected_phases(p, case)[k] for p in plans) / 2 for k in PHASES.get(case, {})}
    comm = summary["comm"]
    return {"case": case, "status": summary["status"], "measured": measured, "projected": projected,
            "ratio": measured / projected, "spread": (before["totals"]["wall_seconds_in_process"],
                                                      after["totals"]["wall_seconds_in_process"]),
            "phases": {k: (summary["phase_seconds"].get(k, 0.0), v) for k, v in phases.items()},
            "bytes": {d: (comm[f"{d}_bytes"], before["comm"][f"{d}_bytes"]) for d in ("down", "up")}}


def report(r: dict) -> bool:
    ok_time = 1 / TOLERANCE <= r["ratio"] <= TOLERANCE
    ok_bytes = all(abs(m / max(p, 1) - 1) <= 0.01 for m, p in r["bytes"].values())
    print(f"\n{r['case']}: measured {r['measured']:.1f} s, projected {r['projected']:.1f} s (plans before and "
          f"after the run: {r['spread'][0]:.1f}, {r['spread'][1]:.1f} s) -> measured/projected "
          f"{r['ratio']:.2f} [{'ok' if ok_time else 'OUTSIDE'} 1/{TOLERANCE}..{TOLERANCE}]")
    for phase, (m, p) in r["phases"].items():
        print(f"  phase {phase:<11} measured {m:7.1f} s  projected {p:7.1f} s  ratio {m / max(p, 1e-9):.2f}")
    for d, (m, p) in r["bytes"].items():
        print(f"  bytes {d:<5} measured {m:>12,}  counted {int(p):>12,}  ratio {m / max(p, 1):.4f}")
    return ok_time and ok_bytes and r["status"] == "completed"


def main(argv: list[str] | None = None) -> int:
    shared = common_args(threads=0, helps={"threads": "torch threads for plan and run alike (0: torch's default)"})
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[shared])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--clients", type=int, default=4)
    a = ap.parse_args(argv)
    import torch

    pin_threads(a.threads)
    print(f"torch threads {torch.get_num_threads()}, {a.clients} clients")
    results = [check(c, CASES[c], a.clients) for c in a.cases]
    passed = [report(r) for r in results]
    print("\nplan check:", "passed" if all(passed) else "FAILED",
          " ".join(f"{r['case']}={r['ratio']:.2f}" for r in results))
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
