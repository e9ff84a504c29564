"""Tiny priors packaged with fedapp, so that a fresh machine runs the default experiment without
first spending minutes building its prior.

A packaged prior is a copy of a built cache folder, kept under `packaged/<cache folder name>/`: its weights
stored in float16 (half the bytes; `from_pretrained` loads them back into the float32 modules), its
configs, tokenizer and prior_meta.json as built, and MANIFEST.json with every file's sha256. Because the
folder name is the build's content key (cache.py), a packaged copy is used only for exactly the build it
was made from: a change to the recipe makes a new key, and the copy is then simply not found.

`install_packaged` copies a packaged prior into the cache when each file's hash checks; a copy that fails
is refused with one warning line and the caller builds the prior as before. Rebuilt by one command:
`python -m fedapp.models.prior.tiny --dataset digit-styles --package` (builds when not cached, evaluates,
then packages).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
from pathlib import Path

from .cache import publish

log = logging.getLogger("fedapp")

PACKAGED_DIR = "packaged"
PACKAGED_ROOT = Path(__file__).with_name(PACKAGED_DIR)
MANIFEST = "MANIFEST.json"
LEFT_OUT = {"samples.png"}  # the build's sample grid: documentation, not part of the prior


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _half(src: Path, dest: Path) -> None:
    """A safetensors file with its floating-point tensors in float16 (the rest as they are)."""
    from safetensors.torch import load_file, save_file

    tensors = {k: v.half() if v.is_floating_point() else v for k, v in load_file(src).items()}
    save_file(tensors, dest, metadata={"format": "pt"})


def package(folder: str | Path, root: str | Path | None = None) -> Path:
    """Write the packaged copy of the built prior `folder` into `root/<folder name>` (default: the package's;
    replacing an old copy of the same build) and return it."""
    folder, root = Path(folder), Path(root if root is not None else PACKAGED_ROOT)
    if not (folder / "prior_meta.json").is_file():
        raise ValueError(f"package: {folder} is not a built tiny prior (no prior_meta.json)")

    def write(tmp: Path) -> None:
        hashes = {}
        for f in sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in LEFT_OUT):
            rel = f.relative_to(folder)
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            if f.suffix == ".safetensors":
                _half(f, tmp / rel)
            else:
                shutil.copyfile(f, tmp / rel)
            hashes[rel.as_posix()] = _sha256(tmp / rel)
        (tmp / MANIFEST).write_text(json.dumps(hashes, indent=2, sort_keys=True))

    dest = root / folder.name
    shutil.rmtree(dest, ignore_errors=True)
    return publish(dest, write)


def verify(copy: str | Path) -> str | None:
    """Why the packaged copy cannot be trusted (a file missing, extra or changed), None when every hash
    matches its manifest. Never raises."""
    copy = Path(copy)
    try:
        expected = json.loads((copy / MANIFEST).read_text())
        present = {p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file()} - {MANIFEST}
        if present != set(expected):
            diff = sorted(present ^ set(expected))
            return f"files differ from {MANIFEST}: {', '.join(diff[:3])}"
        for rel, digest in sorted(expected.items()):
            if _sha256(copy / rel) != digest:
                return f"{rel} does not match its sha256 in {MANIFEST}"
    except (OSError, ValueError, AttributeError) as err:
        return f"{MANIFEST} unreadable ({type(err).__name__}: {err})"
    return None


def _roots(root: str | Path | None) -> list[Path]:
    """Where packaged priors may be: `root` when given; else beside this module and at the same path under
    every sys.path entry. A Flower app bundle carries text files only (.py, .toml, .json, ...), so when
    `flwr run` imports fedapp from its installed bundle, the weights are where pip put fedapp (site-packages,
    or the source tree on an editable install's path)."""
    if root is not None:
        return [Path(root)]
    rel = Path(*__name__.split(".")[:-1], PACKAGED_DIR)  # fedapp/models/prior/tiny/packaged
    roots = [PACKAGED_ROOT] + [Path(entry) / rel for entry in sys.path if entry]
    return list(dict.fromkeys(r.resolve() for r in roots if r.is_dir()))


def _check(folder: str | Path, root: str | Path | None) -> tuple[Path | None, str | None]:
    """(the first packaged copy of `folder`'s build whose hashes hold, None) or (None, why the first copy
    found was refused; None when there is none)."""
    refused = None
    for r in _roots(root):
        copy = r / Path(folder).name
        if not (copy / MANIFEST).is_file():
            continue
        why = verify(copy)
        if why is None:
            return copy, None
        refused = refused or why
    return None, refused


def packaged_copy(folder: str | Path, root: str | Path | None = None) -> Path | None:
    """The packaged copy of the build whose cache folder is `folder` (its hashes checked), or None."""
    return _check(folder, root)[0]


def install_packaged(folder: str | Path, root: str | Path | None = None) -> bool:
    """Copy the packaged prior of `folder`'s build into `folder` (the cache); True when installed. False when
    none is packaged or its hashes fail (one warning line): the caller then builds it."""
    folder = Path(folder)
    copy, why = _check(folder, root)
    if copy is None:
        if why is not None:
            log.warning("packaged prior %s refused: %s; building it instead", folder.name, why)
        return False

    def write(tmp: Path) -> None:
        shutil.copytree(copy, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MANIFEST))

    publish(folder, write)
    log.info("tiny prior %s installed from the package's copy (float16 weights)", folder.name)
    return True


def packaged_bytes(root: str | Path | None = None) -> int:
    """Bytes under `root` (default: every packaged prior together; the package's budget for them is 10 MB)."""
    root = Path(root if root is not None else PACKAGED_ROOT)
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0

