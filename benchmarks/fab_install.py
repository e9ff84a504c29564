"""The app bundle (FAB) every deployed message installs: this project's, against the whole project bundled.

    python benchmarks/fab_install.py [--repeats 10]

Builds two bundles with Flower's own function (the one `flwr run` and `flwr build` call): the app's, as
pyproject.toml's [tool.flwr.app] fab-include selects it, and the whole project (the same files without
fab-include: docs/, experiments/, benchmarks/, tests/ and presets/ too), which is what Flower bundles by default.
Then installs each with Flower's own installer (unzip, check every file's sha256, copy in), as the ServerApp and
every deployed ClientApp message do: once into a fresh Flower home, then --repeats more times, the two bundles
interleaved, with the app already installed there (every message after a node's first: unzip and hash check
only). It prints each bundle's files and bytes and its install seconds, and the app's over the whole project's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
import tomllib
import warnings
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def quiet():
    """Flower's own deprecation warning (pathspec) and its install line, once per install, kept off the table."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def bundles() -> dict[str, bytes]:
    """{name: FAB bytes}: the app's (pyproject's fab-include) and the whole project's (no fab rules) less
    docs/results/, the measured tables, whose JSON alone takes Flower's default bundle past its 10 MB limit."""
    import tomli_w
    from flwr.cli.build import build_fab_from_disk, build_fab_from_files
    from flwr.cli.utils import collect_files

    files: dict = {k: v for k, v in collect_files(ROOT).items() if not str(k).startswith("docs/results/")}
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for key in ("fab-include", "fab-exclude"):
        config["tool"]["flwr"]["app"].pop(key, None)
    files["pyproject.toml"] = tomli_w.dumps(config).encode()
    with quiet():
        return {"fab-include": build_fab_from_disk(ROOT), "whole project": build_fab_from_files(files)[0]}


def install_seconds(fab: bytes, home: Path) -> float:
    from flwr.cli.install import install_from_fab

    t = time.perf_counter()
    with quiet():
        install_from_fab(fab, install_dir=home, skip_prompt=True)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=10, help="installs of each bundle once installed, interleaved")
    a = ap.parse_args(argv)
    load = os.getloadavg()
    fabs = bundles()
    first, again = {}, {name: [] for name in fabs}
    with tempfile.TemporaryDirectory(prefix="fedapp-fab-") as tmp:
        homes = {name: Path(tmp) / f"home{k}" for k, name in enumerate(fabs)}
        for name, fab in fabs.items():
            first[name] = install_seconds(fab, homes[name])
        for _ in range(a.repeats):
            for name, fab in fabs.items():
                again[name].append(install_seconds(fab, homes[name]))
    base = "whole project"
    print(f"{'bundle':>14} {'entries':>7} {'MB':>6} {'first install s':>15} {'install s, mean (median)':>25} "
          f"{'bytes / whole':>13} {'install / whole':>15}")
    for name, fab in fabs.items():
        files = len(zipfile.ZipFile(io.BytesIO(fab)).namelist())
        mean, median = statistics.mean(again[name]), statistics.median(again[name])
        print(f"{name:>14} {files:>7} {len(fab) / 1e6:>6.2f} {first[name]:>15.3f} {f'{mean:.4f} ({median:.4f})':>25} "
              f"{len(fab) / len(fabs[base]):>13.3f} {mean / statistics.mean(again[base]):>15.3f}")
    print(f"{a.repeats} installs of each once installed; load average (1 min) {load[0]:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end, on {os.cpu_count()} cores; Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
