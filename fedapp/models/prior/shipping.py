"""Shipping a prior's weights in a message: any prior folder (tiny or SD layout) as bytes and back.

A server that has the prior sends prior_to_bytes(folder) to clients that cannot load it; they unpack
it with prior_from_bytes into the prior cache and load the folder like any other.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

from .tiny.cache import cache_root, publish


def prior_to_bytes(folder: str | Path) -> bytes:
    """A deterministic tar of the prior folder (sorted names, zeroed times/owners): same files, same bytes."""
    folder = Path(folder)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            info = tarfile.TarInfo(path.relative_to(folder).as_posix())
            info.size, info.mtime, info.mode = path.stat().st_size, 0, 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)
    return buf.getvalue()


def prior_from_bytes(data: bytes, cache_dir: str | Path | None = None) -> Path:
    """Unpack prior_to_bytes output into `<root>/shipped-<sha256[:16]>` (content-addressed; reused if present).
    Only plain files with relative paths inside the folder are accepted: the bytes come from the network."""
    folder = cache_root(cache_dir) / f"shipped-{hashlib.sha256(data).hexdigest()[:16]}"
    if folder.is_dir():
        return folder

    def unpack(tmp: Path) -> None:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            for m in tar.getmembers():
                parts = Path(m.name).parts
                if not m.isfile() or m.name.startswith("/") or ".." in parts:
                    raise ValueError(f"prior bytes: refusing tar member {m.name!r}")
                target = tmp.joinpath(*parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(m).read())

    return publish(folder, unpack)
