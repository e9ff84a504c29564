"""One self-contained Markdown page of a run: `python -m fedapp.report <run dir>` (the server also
writes it, as report.md, when a run ends). Config, status and timings, final metrics, the per-round
table, failures, communication per client, privacy, and links to every figure of the run folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPORT = "report.md"


def _table(rows: list[dict[str, Any]], keys: list[str]) -> list[str]:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, (dict, list)):
            return "…"
        return "" if v is None else str(v)

    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    out += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]
    return out


def phases_text(seconds: dict[str, float]) -> str:
    """summary.json's phase_seconds in words, a nested phase inside its outer one's parentheses:
    `prior 1.0 s, ship-prior 2.8 s (of which query.prior 2.8 s), train 61.0 s`."""
    from fedapp.results import phase_tree

    def words(nodes: list) -> str:
        return ", ".join(f"{name}" + (f" {sec:.1f} s" if sec is not None else "")
                         + (f" (of which {words(inner)})" if inner else "") for name, sec, inner in nodes)

    return words(phase_tree(seconds))


def render(run_dir: str | Path) -> str:
    """The page's Markdown text, from the files the run wrote (missing ones are said to be missing)."""
    root = Path(run_dir)
    read = lambda name: json.loads((root / name).read_text()) if (root / name).is_file() else None  # noqa: E731
    summary, config = read("summary.json") or {}, read("config.json") or {}
    lines = [f"# Run {root.name}", ""]
    lines += [f"- status: **{summary.get('status', 'unknown')}**"
              + (f" ({summary['error']})" if summary.get("error") else ""),
              f"- method `{summary.get('method')}`, dataset `{summary.get('dataset')}`, partitioner "
              f"`{summary.get('partitioner')}`, {summary.get('num_clients')} clients, seed {summary.get('seed')}",
              f"- wall time {summary.get('wall_seconds', '?')} s; phases: "
              + phases_text(summary.get("phase_seconds") or {}), ""]
    metrics = summary.get("metrics") or {}
    scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool)) or v is None}
    if scalars:
        lines += ["## Final metrics", ""] + _table([scalars], list(scalars)) + [""]
    path = root / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    rounds = [r for r in rows if "round" in r]
    if rounds:
        keys = [k for k in rounds[-1] if not isinstance(rounds[-1][k], (dict, list))]
        lines += ["## Per round", ""] + _table(rounds, keys) + [""]
    failures = summary.get("failures") or []
    lines += ["## Failures", ""] + (_table(failures, ["phase", "node_id", "partition_id", "reason"]) if failures
                                     else ["none"]) + [""]
    comm = summary.get("comm") or {}
    if comm:
        per = [{"client": c, **v} for c, v in sorted((comm.get("per_client") or {}).items())]
        lines += ["## Communication", "", f"up {comm.get('up_bytes')} bytes, down {comm.get('down_bytes')} bytes", ""]
        lines += _table(per, ["client", "up_bytes", "down_bytes", "messages_up", "messages_down", "compute_seconds"])
        lines += [""]
    if summary.get("privacy"):
        lines += ["## Privacy", ""] + [f"- {k}: {v}" for k, v in summary["privacy"].items()] + [""]
    figures = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.png"))
    lines += ["## Figures", ""] + [f"![{f}]({f})" for f in figures] + ([] if figures else ["none"]) + [""]
    if isinstance(config.get("method"), str):  # common keys and the method's (an older run lists every method's)
        from fedapp.config import method_scoped

        config = method_scoped(config, config["method"])
    lines += ["## Config", ""] + _table([{"key": k, "value": v} for k, v in sorted(config.items())], ["key", "value"])
    return "\n".join(lines) + "\n"


def write_report(run_dir: str | Path) -> Path:
    from fedapp.results import atomic_write_bytes

    path = Path(run_dir) / REPORT
    atomic_write_bytes(path, render(run_dir).encode())
    return path


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m fedapp.report", description="Write <run dir>/report.md.")
    ap.add_argument("run_dir")
    a = ap.parse_args(argv)
    if not (Path(a.run_dir) / "summary.json").is_file():
        sys.exit(f"run_dir={a.run_dir!r}: no summary.json there; must be a run folder")
    print(write_report(a.run_dir))


if __name__ == "__main__":
    main()
