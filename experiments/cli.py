"""The options the experiments' and benchmarks' commands share, declared once: `--set`, `--out`, `--runs` (or
`--runs-dir`), `--threads`, `--seeds` and `--dataset` as an argparse parent parser (common_args), and the one place
where `--threads` takes effect (pin_threads)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from experiments import common


def thread_count(text: str) -> int:
    """--threads: a count of torch threads, 0 for torch's default (every core)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"--threads={text!r}: must be 0 (torch's default, every core) or a positive "
                                         "count of threads")
    return n


# Each shared option by its dest: the flag is "--" + dest with dashes. Help texts say what the option means in
# every command; a command words its own (what its --out holds) through common_args(helps=...).
SHARED: dict[str, dict[str, Any]] = {
    "dataset": dict(help="the dataset: a name of feddata.DATASETS, a Hugging Face dataset id or a folder"),
    "seeds": dict(help="comma-separated run seeds, e.g. 0,1,2"),
    "set": dict(nargs="*", metavar="KEY=VALUE", help="run-config overrides, e.g. model=resnet18 local-epochs=2"),
    "out": dict(help="folder the results (JSON, figures) are written into"),
    "runs": dict(help="folder of the runs' own folders"),
    "runs_dir": dict(help="folder of the runs' own folders"),
    "threads": dict(type=thread_count, metavar="N",
                    help="torch threads of this process and the processes it starts (0: torch's default)"),
}


def common_args(helps: dict[str, str] | None = None, **defaults: Any) -> argparse.ArgumentParser:
    """A parent parser (`argparse.ArgumentParser(parents=[common_args(...)])`) holding the shared options named in
    `defaults`, each at the default given there: `common_args(out="docs/results", runs="runs/recipe", threads=2)`.
    `helps` replaces an option's help text for one command."""
    helps = helps or {}
    unknown = sorted(set(defaults) - set(SHARED)) + sorted(set(helps) - set(defaults))
    if unknown:
        raise TypeError(f"common_args: {', '.join(unknown)}: not a shared option given a default; "
                        f"shared options: {', '.join(SHARED)}")
    p = argparse.ArgumentParser(add_help=False)
    for dest, spec in SHARED.items():  # one order in every command's --help
        if dest in defaults:
            default = list(defaults[dest]) if isinstance(defaults[dest], (list, tuple)) else defaults[dest]
            p.add_argument("--" + dest.replace("_", "-"), **{**spec, "default": default,
                                                             **({"help": helps[dest]} if dest in helps else {})})
    return p


def pin_threads(threads: int, jobs: int = 1) -> None:
    """--threads taking effect: refused when `jobs` processes of `threads` each would oversubscribe the cores
    (common.check_cpu_budget); else torch's threads in this process and OMP_NUM_THREADS for the processes it starts
    (Ray workers, spawned jobs) set to `threads`. 0 leaves torch's default."""
    common.check_cpu_budget(jobs, threads)
    if threads:
        import torch  # here, not at import: `--help` and the parsers stay quick

        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
