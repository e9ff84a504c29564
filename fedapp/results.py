"""The run folder `<out-dir>/<run-name>/`: config.json, metrics.jsonl, summary.json,
comm.json, images/ and plots/. Every file is written atomically (temp file + rename), so a
crash never leaves a half-written result."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

PHASE_SEP = "/"  # summary.json's phase_seconds: a phase run inside another is `outer/inner`


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return _jsonable(obj.item())
    return obj


def _umask() -> int:
    """The process umask, read without setting it (os.umask would change it for every thread at once)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no /proc: read by setting, then restore
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write through a temp file + rename. The file gets the mode a plain open() would give it
    (0666 less the umask: readable by the user's group), not mkstemp's private 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_png(fig: Any, path: Path, dpi: int = 110) -> Path:
    """A matplotlib figure as a PNG at `path`, written atomically (its folder made), the figure closed."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())
    return path


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(_jsonable(obj), indent=2) + "\n").encode())


class CommLedger:
    """Bytes up and down and the clients' compute seconds, per client (partition id or node id) and phase."""

    def __init__(self) -> None:
        self.table: dict[str, dict[str, dict[str, float]]] = defaultdict(
            lambda: defaultdict(lambda: {"up": 0, "down": 0, "messages_up": 0, "messages_down": 0, "seconds": 0.0}))

    def add(self, client: str, phase: str, direction: str, nbytes: int) -> None:
        row = self.table[str(client)][phase]
        row[direction] += int(nbytes)
        row[f"messages_{direction}"] += 1

    def add_seconds(self, client: str, phase: str, seconds: float) -> None:
        """The client's own wall time on a message it answered (a reply reused from a cache reports the
        seconds its first computation took: the method's cost, not the cache's)."""
        self.table[str(client)][phase]["seconds"] += seconds

    def totals(self) -> dict[str, Any]:
        per_client = {
            c: {"up_bytes": sum(p["up"] for p in phases.values()),
                "down_bytes": sum(p["down"] for p in phases.values()),
                "messages_up": sum(p["messages_up"] for p in phases.values()),
                "messages_down": sum(p["messages_down"] for p in phases.values()),
                "compute_seconds": sum(p["seconds"] for p in phases.values())}
            for c, phases in self.table.items()
        }
        return {
            "up_bytes": sum(v["up_bytes"] for v in per_client.values()),
            "down_bytes": sum(v["down_bytes"] for v in per_client.values()),
            "compute_seconds": sum(v["compute_seconds"] for v in per_client.values()),
            "per_client": per_client,
        }

    def as_dict(self) -> dict[str, Any]:
        return {"totals": self.totals(),
                "by_phase": {c: dict(p) for c, p in self.table.items()}}


def phase_tree(seconds: Mapping[str, float]) -> list[tuple[str, float, list]]:
    """summary.json's phase_seconds as a tree: [(name, seconds, [nested phases, alike])], in the order the
    phases first appear. `outer/inner` (PHASE_SEP) is inner, run inside outer, whose seconds include its own;
    so the top level's seconds sum to no more than the wall time. A nested key whose outer phase is missing
    (a hand-edited summary) still hangs under it, with no seconds of its own (None)."""
    root: list[tuple[str, float | None, list]] = []
    nodes: dict[str, tuple[str, float | None, list]] = {}
    for key in seconds:
        parts = key.split(PHASE_SEP)
        for i in range(1, len(parts) + 1):
            path = PHASE_SEP.join(parts[:i])
            if path not in nodes:
                nodes[path] = (parts[i - 1], seconds.get(path), [])
                (nodes[PHASE_SEP.join(parts[:i - 1])][2] if i > 1 else root).append(nodes[path])
    return root  # type: ignore[return-value]


def phase_rows(seconds: Mapping[str, float]) -> list[tuple[int, str, float | None]]:
    """phase_tree flattened: (depth, name, seconds), each phase right above the ones nested in it."""
    def walk(nodes: list, depth: int) -> Iterator[tuple[int, str, float | None]]:
        for name, sec, inner in nodes:
            yield depth, name, sec
            yield from walk(inner, depth + 1)

    return list(walk(phase_tree(seconds), 0))


def scalars(row: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) of every number in a metrics row; a nested dict's as `outer/inner`, the grouping
    TensorBoard shows. Strings, booleans and NaN (written as null) are not scalars."""
    for key, value in row.items():
        if isinstance(value, dict):
            yield from scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield prefix + key, value


class RunDir:
    """One run's folder; all writes are atomic, except TensorBoard's event files (log.tensorboard),
    which its writer appends to."""

    def __init__(self, root: str | Path, tensorboard: bool = False):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._metrics: list[dict[str, Any]] = []
        self.tensorboard = tensorboard
        self._tb: Any = None  # the SummaryWriter, opened with the first row
        self._purge_step: int | None = None  # a resumed run's first new round

    def path(self, *parts: str) -> Path:
        p = self.root.joinpath(*parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write_json(self, name: str, obj: Any) -> Path:
        p = self.path(name)
        atomic_write_json(p, obj)
        return p

    def reload_metrics(self, keep: Callable[[dict[str, Any]], bool]) -> None:
        """Continue metrics.jsonl of a resumed run: keep the lines `keep` accepts, drop the rest."""
        path = self.root / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        self._metrics = [r for r in rows if keep(r)]
        rounds = [r["round"] for r in self._metrics if "round" in r]
        # TensorBoard hides the earlier run's events from this step on (those rows were dropped above)
        self._purge_step = max(rounds) + 1 if rounds else None

    def log_metrics(self, record: dict[str, Any]) -> None:
        """Append one line per round/phase; the file is rewritten whole (atomically)."""
        row = _jsonable(record)
        self._metrics.append(row)
        body = "".join(json.dumps(r) + "\n" for r in self._metrics)
        atomic_write_bytes(self.path("metrics.jsonl"), body.encode())
        if self.tensorboard:
            self._log_scalars(row)

    def _log_scalars(self, row: dict[str, Any]) -> None:
        """The row's numbers as TensorBoard scalars: a round row's at step = its round, a phase row's
        (one-shot methods) as `<phase>/<metric>` at step = its line number in metrics.jsonl."""
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.root), purge_step=self._purge_step)
        step = row["round"] if "round" in row else len(self._metrics) - 1
        prefix = f"{row['phase']}/" if "round" not in row and "phase" in row else ""
        for tag, value in scalars({k: v for k, v in row.items() if k != "round"}, prefix):
            self._tb.add_scalar(tag, value, step)
        self._tb.flush()  # an operator's TensorBoard sees each round as it ends

    def close(self) -> None:
        """Close the TensorBoard writer, if one is open."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    @property
    def metrics(self) -> list[dict[str, Any]]:
        return list(self._metrics)

    def save_figure(self, fig: Any, name: str) -> Path:
        """Save a matplotlib figure under plots/ atomically."""
        import io

        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        p = self.path("plots", name)
        atomic_write_bytes(p, buf.getvalue())
        return p

    def plot_phases(self, seconds: Mapping[str, float], name: str = "phases.png",
                    wall: float | None = None) -> Path | None:
        """Wall time per phase (summary.json's phase_seconds) as horizontal bars; a nested phase
        (`outer/inner`) right below its outer one, indented and lighter (its time is part of the outer bar's),
        and the run's wall time as a dashed line."""
        if not seconds:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from matplotlib.colors import to_rgba

        rows = phase_rows(seconds)
        fig, ax = plt.subplots(figsize=(5, 0.4 * len(rows) + 1))
        ax.barh(range(len(rows)), [sec or 0.0 for _, _, sec in rows],
                color=[to_rgba("C0", 1.0 if depth == 0 else 0.45) for depth, _, _ in rows],
                height=[0.8 if depth == 0 else 0.5 for depth, _, _ in rows])
        ax.set_yticks(range(len(rows)), labels=["    " * depth + ("└ " if depth else "") + label
                                                for depth, label, _ in rows])
        if any(depth for depth, _, _ in rows):  # left-aligned labels, so that the indent shows
            renderer = fig.canvas.get_renderer()
            labels = ax.get_yticklabels()
            width = max(t.get_window_extent(renderer).width for t in labels) * 72 / fig.dpi  # points
            ax.tick_params(axis="y", pad=width + 4)
            for t in labels:
                t.set_horizontalalignment("left")
        ax.invert_yaxis()
        ax.set_xlabel("seconds" + (" (an indented phase ran inside the one above it)"
                                   if any(depth for depth, _, _ in rows) else ""))
        if wall:
            ax.axvline(wall, color="k", linestyle="--", linewidth=1, label=f"wall time {wall:.1f} s")
            ax.legend(loc="best", fontsize="small")
        p = self.save_figure(fig, name)
        plt.close(fig)
        return p

    def plot_label_distribution(self, partitioner: Any, name: str = "label_distribution.png",
                                max_clients: int = 50) -> tuple[Path, Any]:
        """Images per class and client, with flwr-datasets' plot_label_distributions, of a flwr-datasets
        partitioner over a `label` column (fedapp.data.label_partitioner); returns the file and the counts
        (a DataFrame: a row per client, a column per class). Past max_clients, the first ones are drawn.

        Where the partitioner gives clients a domain (feddata's AssignedPartitioner.client_domains), each
        client's bar is labelled with its domain under its id (the `domain` split: every client holds the
        same classes, what differs is the domain), or the title names the one domain all clients share."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from flwr_datasets.visualization import plot_label_distributions

        n = partitioner.num_partitions
        shown = f"first {max_clients} of {n} clients" if n > max_clients else f"{n} clients"
        domains = list(getattr(partitioner, "client_domains", None) or [None] * n)
        fig, ax, counts = plot_label_distributions(
            partitioner, "label", max_num_partitions=max_clients, legend=True, legend_title="class",
            title=f"Images per class and client ({shown}; train + test)",
            figsize=(min(3 + 0.35 * min(n, max_clients), 16), 4))
        drawn = [domains[int(pid)] for pid in counts.index]
        if any(d is not None for d in drawn):
            if len(set(drawn)) > 1:  # what tells the clients apart: their domains
                few = len(drawn) <= 12
                ax.set_xticks(range(len(drawn)), labels=[f"{pid}\n{d or '-'}" if few else f"{pid} {d or '-'}"
                                                         for pid, d in zip(counts.index, drawn)],
                              rotation=0 if few else 90)
                ax.set_xlabel("client (its domain below its id)" if few else "client and its domain")
                ax.set_title(f"Images per class, client and domain ({shown}; train + test)")
            else:
                ax.set_title(f"Images per class and client ({shown}, all of domain {drawn[0]}; train + test)")
        p = self.save_figure(fig, name)
        plt.close(fig)
        return p, counts

    def plot_accuracy(self, name: str = "accuracy.png") -> Path | None:
        """Accuracy per round from metrics.jsonl (global and mean client test accuracy)."""
        rows = [r for r in self._metrics if "round" in r and "accuracy" in r]
        if not rows:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot([r["round"] for r in rows], [r["accuracy"] for r in rows], "o-", label="global test")
        client_rows = [r for r in rows if r.get("client_accuracy") is not None]
        if client_rows:
            ax.plot([r["round"] for r in client_rows], [r["client_accuracy"] for r in client_rows],
                    "s--", label="clients' test (weighted)")
        ax.set_xlabel("round")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
        p = self.save_figure(fig, name)
        plt.close(fig)
        return p
