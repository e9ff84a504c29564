"""What several experiments share: log levels, `--set key=value` overrides, the argparse prog name, the
CPU budget of --jobs/--threads, and what every table reports beside its means: a convergence verdict per
cell (classification_verdict, generative_verdict, all_converged) and same-seed differences against the
paper's main baseline (paired_difference, paired_text)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import statistics
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator


def prog(name: str) -> str:
    """argparse's prog for `python -m experiments <name>`."""
    return f"python -m experiments {name}"


def quiet_logs() -> None:
    """Warnings only from Flower's and fedapp's loggers (a line per round, phase and client otherwise)."""
    for name in ("flwr", "fedapp"):
        lg = logging.getLogger(name)
        if name == "fedapp" and not lg.handlers:  # run_server would add an INFO handler
            lg.addHandler(logging.StreamHandler())
            lg.propagate = False
        lg.setLevel(logging.WARNING)


def subset_of(option: str, text: str, allowed: Iterable[str]) -> list[str]:
    """The comma-separated values of `--option`, each of which must be among `allowed` (else one line that
    names the option, the values not allowed and what is)."""
    allowed, given = list(allowed), text.split(",")
    bad = [v for v in given if v not in allowed]
    if bad:
        raise SystemExit(f"--{option}={','.join(bad)}: must be among {','.join(allowed)}")
    return given


def parse_set(items: list[str]) -> dict[str, Any]:
    """`key=value` run-config overrides; a value is read as JSON when it parses (numbers, true/false)."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


BACKENDS = ("inprocess", "ray")


@contextmanager
def config_errors_exit() -> Iterator[None]:
    """A user error in a run config (ConfigError) ends the command with its one line, no traceback."""
    from fedapp.options import ConfigError

    try:
        yield
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None


def check_configs(configs: list[dict[str, Any]], num_clients: int) -> None:
    """Every run config of the grid resolves (keys, values, data for `num_clients`), or the command
    stops with the one-line error before it has written anything."""
    from fedapp.simulation import resolve_run_config

    with config_errors_exit():
        for flat in configs:
            resolve_run_config(flat, num_clients)


def stopped_run(flat: dict[str, Any], num_clients: int) -> str | None:
    """The folder of a stopped run of this very config (a resumable method's, with a checkpoint, not
    completed: cut by a time limit, killed, or its federation went down), for `run` to continue from
    its last round; None to start the run afresh."""
    from fedapp.config import ConfigError
    from fedapp.simulation import resolve_run_config

    folder = resolve_run_config(flat, num_clients)[1]
    summary, meta = folder / "summary.json", folder / "checkpoint.json"
    if not meta.is_file() or (summary.is_file() and json.loads(summary.read_text()).get("status") == "completed"):
        return None
    if "progress" not in json.loads(meta.read_text()):  # written before checkpoints kept it: its counts are lost
        print(f"{folder}: starting over (its checkpoint does not keep the bytes and seconds spent)", flush=True)
        return None
    try:
        resolve_run_config({**flat, "resume": str(folder)}, num_clients)  # same config, resumable method
    except ConfigError as err:
        print(f"{folder}: starting over ({err})", flush=True)
        return None
    return str(folder)


def run(flat: dict[str, Any], num_clients: int, backend: str, reply_cache: Any = None) -> dict[str, Any]:
    """One run of the grid; returns its summary.json. backend "ray": `fedapp.simulate` (Flower's Ray
    simulation); "inprocess": `fedapp.simulation.simulate_in_process` (same server, clients served in
    this process, replies reused through `reply_cache` where the clients' work repeats). A stopped run of
    the same config continues from its last round (stopped_run; fedapp's `resume`, exact: the same client
    samples and seeds per round), so a cell cut by a time limit loses at most a round."""
    stopped = stopped_run(flat, num_clients)
    if stopped:
        print(f"continuing {stopped} from its last checkpoint", flush=True)
        flat = {**flat, "resume": stopped}
    if backend == "ray":
        import fedapp

        return fedapp.simulate(flat, num_clients=num_clients)
    from fedapp.simulation import simulate_in_process

    return simulate_in_process(flat, num_clients, reply_cache=reply_cache)


def accuracy_curve(summary: dict[str, Any]) -> list[float]:
    """The server's global test accuracy after rounds 1..R of a round-based run (round 0 is the initial
    model), from its metrics.jsonl."""
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return [r["accuracy"] for r in sorted(rows, key=lambda r: r["round"]) if r["round"] > 0]


def kid_cell(row: dict[str, Any], key: str) -> str:
    """A table cell "KID ± std over subsets" (fedapp.metrics.kernel_distance); n/a for rows measured before KID."""
    return f"{row[key]:.3f}±{row[key + '_std']:.3f}" if key in row else "n/a"


def over_seeds(rows: list[dict[str, Any]], keys: Iterable[str]) -> dict[str, float]:
    """The runs of one table cell (one per seed): for each key, the mean over the runs that report it as a
    number, `<key>_seed_std` its std (ddof 0; not `_std`, which a KID already uses for its subsets), and
    `<key>_runs` where fewer runs than the cell's have it (a figure added after some were measured)."""
    out: dict[str, float] = {}
    for k in keys:
        vals = [r[k] for r in rows if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
        if vals:
            out[k] = statistics.fmean(vals)
            out[k + "_seed_std"] = statistics.pstdev(vals)
            if len(vals) < len(rows):
                out[k + "_runs"] = len(vals)
    return out


# ---- CPU budget ------------------------------------------------------------------------------------------
def available_cpus() -> int:
    """The cores this process may run on (its affinity mask where the OS has one, else os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def check_cpu_budget(jobs: int, threads: int, cpus: int | None = None) -> None:
    """Stop with one line when `jobs` processes of `threads` torch threads each would oversubscribe the
    cores (threads 0: torch's default, every core): oversubscribed torch threads slow every process down."""
    cpus = cpus or available_cpus()
    per_job = threads or cpus
    if jobs * per_job > cpus:
        shown = threads if threads else f"0 (torch's default: {cpus})"
        raise SystemExit(f"error: --jobs {jobs} x --threads {shown} = {jobs * per_job} threads > {cpus} CPU cores: "
                         "lower --jobs or --threads")


# ---- convergence verdicts --------------------------------------------------------------------------------
WINDOW, LAG, TOLERANCE_POINTS = 5, 10, 1.0  # classification: last-5-round mean, 10 rounds apart, < 1 point
GENERATIVE_THRESHOLD = 0.90  # generative: the oracle's samples read as the requested class


def classification_verdict(curve: list[float]) -> dict[str, Any]:
    """A classification cell's verdict from one accuracy-per-round curve (rounds 1..R): converged when the
    last-5-round mean at round R, mean(curve[R-5:R]), and at round R-10, mean(curve[R-15:R-10]), differ by
    less than 1 point (|delta| < 1 on a curve in %, < 0.01 on a curve in [0, 1]: a curve whose values all lie
    in [0, 1] is read as fractions). A curve of fewer than 15 rounds is not converged ("too short")."""
    if len(curve) < WINDOW + LAG:
        return {"converged": False, "reason": "too short", "rounds": len(curve)}
    scale = 100.0 if all(0.0 <= v <= 1.0 for v in curve) else 1.0  # delta in points either way
    delta = scale * (statistics.fmean(curve[-WINDOW:]) - statistics.fmean(curve[-(WINDOW + LAG):-LAG]))
    converged = abs(delta) < TOLERANCE_POINTS
    return {"converged": converged, "delta_points": round(delta, 4), "rounds": len(curve),
            "reason": f"last-{WINDOW} mean moved {delta:+.2f} points over the last {LAG} rounds "
                      f"({'<' if converged else '>='} {TOLERANCE_POINTS:g})"}


def generative_verdict(oracle_sample_accuracy: float | None) -> dict[str, Any]:
    """A generative cell's verdict: converged when its oracle's samples (a fraction in [0, 1]) are read as
    the requested class at least 90% of the time: an oracle below that has not learnt the data, and the
    rows it bounds measure an unfinished training budget. Which oracle is the table's (experiments/pfdm.py:
    centralized-ddpm's sample_accuracy; experiments/dcfm.py: FedFlow's seen-pair composition accuracy)."""
    if oracle_sample_accuracy is None:
        return {"converged": False, "reason": "no oracle run"}
    acc = float(oracle_sample_accuracy)
    # 0.9 itself passes, whatever its last bit: a reading stored as float32 (torch's mean) is 0.89999998; a
    # reading of 400 samples moves in steps of 0.0025, so the tolerance cannot pass a reading that is short
    converged = acc >= GENERATIVE_THRESHOLD - 1e-6
    return {"converged": converged, "oracle_sample_accuracy": acc,
            "reason": f"oracle samples read as the requested class {100 * acc:.1f}% "
                      f"({'>=' if converged else '<'} {100 * GENERATIVE_THRESHOLD:g}%)"}


PLATEAU_WINDOW = 4000  # steps: the last stretch of a budget curve a plateau is read over
PLATEAU_MOVE = 0.01  # the oracle's class reading moves less than 1 point over it (max - min) ...
PLATEAU_LOSS = 0.05  # ... and its training loss changes by less than 5 %


def plateau(points: list[dict[str, Any]], window: int = PLATEAU_WINDOW) -> dict[str, Any]:
    """A budget curve's plateau (points: {"steps", "sample_accuracy", "loss"} by steps): over its last `window`
    steps the oracle's class reading moves < 1 point and its loss is flat. A plateau is a converged budget even
    where the reading stays under GENERATIVE_THRESHOLD: more steps of the same recipe buy nothing."""
    if not points:
        return {"plateau": False, "reason": "no budget curve"}
    last = points[-1]["steps"]
    tail = [p for p in points if p["steps"] >= last - window]
    if len(tail) < 3 or tail[0]["steps"] != last - window:
        return {"plateau": False, "reason": f"the curve has no 3 checkpoints spanning its last {window} steps"}
    readings = [float(p["sample_accuracy"]) for p in tail]
    move = max(readings) - min(readings)
    loss_change = abs(tail[-1]["loss"] - tail[0]["loss"]) / tail[0]["loss"]
    ok = move < PLATEAU_MOVE and loss_change < PLATEAU_LOSS
    needed = f"no plateau: < {100 * PLATEAU_MOVE:g} points and < {100 * PLATEAU_LOSS:g} % needed"
    return {"plateau": ok, "from_steps": tail[0]["steps"], "to_steps": last, "level": statistics.fmean(readings),
            "move": move, "loss_change": loss_change,
            "reason": f"class reading moves {100 * move:.1f} points and loss {100 * loss_change:.1f} % over steps "
                      f"{tail[0]['steps']}-{last} ({'plateau' if ok else needed})"}


def budget_verdict(points: list[dict[str, Any]]) -> dict[str, Any]:
    """A budget curve's verdict: converged at its last checkpoint when the oracle reads >= 90 % there, or when the
    curve has reached its plateau."""
    v = generative_verdict(points[-1]["sample_accuracy"] if points else None)
    if v["converged"] or not points:
        return v
    p = plateau(points)
    return {**v, "converged": p["plateau"], "plateau": p, "reason": f"{v['reason']}; {p['reason']}"}


def all_converged(verdicts: list[dict[str, Any]]) -> dict[str, Any]:
    """A cell of several seeds: converged only if every seed's verdict is (none: not converged); the
    reason is the first failing seed's."""
    failing = [v for v in verdicts if not v["converged"]]
    if not verdicts:
        return {"converged": False, "reason": "no runs", "seeds": 0, "converged_seeds": 0}
    reason = failing[0]["reason"] if failing else verdicts[0]["reason"]
    return {"converged": not failing, "reason": reason, "seeds": len(verdicts),
            "converged_seeds": len(verdicts) - len(failing)}


def verdict_mark(verdict: dict[str, Any] | None) -> str:
    """What a table prints beside a cell: "" when converged, else "not converged"."""
    return "" if verdict and verdict["converged"] else "not converged"


# ---- paired seeds ----------------------------------------------------------------------------------------
def paired_difference(a: dict[Any, float | None], b: dict[Any, float | None],
                      higher_is_better: bool) -> dict[str, Any]:
    """a - b over the seeds both have a number for (keys compared as strings: json keeps seeds as "0"):
    the mean and std (ddof 0, as over_seeds) of the per-seed differences, n, "favour": how many seeds
    favour a (a > b when higher is better, a < b when lower is; a tie favours neither), and the per-seed
    differences themselves ({seed: a - b})."""
    a_, b_ = ({str(k): v for k, v in d.items() if isinstance(v, (int, float))} for d in (a, b))
    per_seed = {k: a_[k] - b_[k] for k in sorted(a_.keys() & b_.keys())}
    diffs = list(per_seed.values())
    if not diffs:
        return {"mean": None, "std": None, "n": 0, "favour": 0, "per_seed": {}}
    favour = sum(d > 0 if higher_is_better else d < 0 for d in diffs)
    return {"mean": statistics.fmean(diffs), "std": statistics.pstdev(diffs), "n": len(diffs), "favour": favour,
            "per_seed": per_seed}


def paired_text(p: dict[str, Any] | None, digits: int = 1, scale: float = 1.0) -> str:
    """"+1.2 ± 0.8 (3/3)": mean ± std of the differences (times `scale`: 100 shows fractions as points),
    (seeds favouring the method / seeds paired)."""
    if not p or not p["n"]:
        return "n/a"
    return f"{scale * p['mean']:+.{digits}f} ± {scale * p['std']:.{digits}f} ({p['favour']}/{p['n']})"


def count_text(value: float | None) -> str:
    """A steps / images-seen cell: a whole number with thousands separators."""
    return "n/a" if value is None else f"{round(value):,}"


def write_block(doc: Path, name: str, text: str) -> None:
    """Replace the generated block `name` of a markdown page (between its two markers, the prose around it
    kept), or append it: a page's table regenerated by the command that measured it."""
    from fedapp.results import atomic_write_bytes

    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    body = doc.read_text() if doc.is_file() else ""
    block = f"{start}\n{text}\n{end}"
    if start in body and end in body:
        body = body[:body.index(start)] + block + body[body.index(end) + len(end):]
    else:
        body = body.rstrip("\n") + f"\n\n{block}\n"
    atomic_write_bytes(doc, body.encode())


def merge_results(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Nested results (split -> method -> seed -> row): every leaf row of `other` that `into` lacks is
    added; rows `into` already has win (they are the caller's fresher measurements)."""
    for key, value in other.items():
        mine = into.get(key)
        if isinstance(mine, dict) and isinstance(value, dict) and "curve" not in value:
            merge_results(mine, value)
        elif key not in into:
            into[key] = value
    return into


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`.lock: two table runners (disjoint cells, the same json) write in turn,
    so neither overwrites the other's rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def json_under(path: Path, setup: dict[str, Any]) -> dict[str, Any]:
    """The json at `path` when it was written under the same setup; {} when absent or another setup's."""
    old = json.loads(path.read_text()) if path.exists() else {}
    return old if old.get("setup") == setup else {}


def results_on_disk(path: Path, setup: dict[str, Any]) -> dict[str, Any]:
    """The results a table json holds under the same setup ({} if none, or another setup's)."""
    return json_under(path, setup).get("results", {})


def seeds_on_disk(path: Path, setup: dict[str, Any]) -> dict[str, Any]:
    """A sweep json's seeds measured under `setup` ({} if none, or another setup's)."""
    return json_under(path, setup).get("seeds", {})


def write_sweep(path: Path, result: dict[str, Any], new_seeds: dict[str, Any],
                summarise: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """A budget sweep's json ({"setup", "seeds", ...}): adds `new_seeds` and the seeds another process wrote
    meanwhile under the same setup (two seeds may run in two processes), then `summarise(seeds)`'s keys."""
    from fedapp.results import atomic_write_json

    with file_lock(path):
        old = json_under(path, result["setup"])
        seeds = {**old.get("seeds", {}), **result["seeds"], **new_seeds}
        result["seeds"] = dict(sorted(seeds.items(), key=lambda kv: int(kv[0])))
        partial = {k: v for k, v in old.get("partial", {}).items() if k not in seeds}
        if partial:  # a seed another process is still measuring
            result["partial"] = partial
        else:
            result.pop("partial", None)
        result.update(summarise(result["seeds"]))
        atomic_write_json(path, result)


def add_sweep_arguments(p: Any) -> None:
    """The option every budget sweep adds to the shared ones (pfdm-budget, dcfm-budget)."""
    p.add_argument("--ref-epochs", type=int, default=8, help="epochs of the readers (fedapp.readers)")


def checkpoint_steps(text: str) -> list[int]:
    """--steps "500,1000,2000": sorted, positive; one clear line otherwise."""
    steps = sorted({int(s) for s in text.split(",") if s.strip()})
    if not steps or steps[0] < 1:
        raise SystemExit(f"--steps={text!r}: must be positive step counts, e.g. 500,1000,2000")
    return steps


def run_sweep(path: Path, setup: dict[str, Any], seeds: str,
              measure: Callable[[int, Callable[[list], None], list], dict[str, Any]],
              summarise: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """Each seed of `seeds` not yet on disk under `setup` measured (`measure(seed, progress, partial)`) and
    written at once (write_sweep): an interrupted sweep resumes, two processes may run two seeds.
    `progress(points)` writes a seed's checkpoints so far under "partial" (never read by the budget: a stopped
    run keeps what it measured); a rerun hands them back as `partial`, for a measure that can continue its run
    (pfdm-budget's train-state file) to keep those it does not measure again; others measure the seed whole.
    Returns the json."""
    from fedapp.results import atomic_write_json

    result = {"setup": setup, "seeds": seeds_on_disk(path, setup)}
    for seed in (int(s) for s in seeds.split(",") if s):
        if str(seed) in result["seeds"]:
            continue

        def progress(points: list, key: str = str(seed)) -> None:
            with file_lock(path):
                keep = json_under(path, setup) or {"setup": setup, "seeds": {}}
                keep.setdefault("partial", {})[key] = {"points": points}
                atomic_write_json(path, keep)

        partial = json_under(path, setup).get("partial", {}).get(str(seed), {}).get("points", [])
        write_sweep(path, result, {str(seed): measure(seed, progress, partial)}, summarise)
    write_sweep(path, result, {}, summarise)
    return result
