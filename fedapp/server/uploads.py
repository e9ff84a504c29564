"""What each client uploaded, kept in the run folder (`log.uploads = true`) so that the privacy audit attacks
a finished run without running it again.

Per phase and client, the last reply that carries arrays, beside the message it answered:
<run dir>/uploads/<phase>/client-<partition id>.safetensors, its tensors named `up/<record>/<array>` and
`down/<record>/<array>`, its metadata the phase, partition id and how many such replies the client sent in the
phase (a FedAvg client's last round's weights and the global model it started that round from). The grid keeps
a reply once its partition claim is accepted and before any strategy validates it: the attacker holds what the
client sent, valid or not. Keeping is telemetry: a reply it cannot write is logged and the run goes on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from flwr.app import RecordDict

from fedapp.results import RunDir, atomic_write_bytes

log = logging.getLogger("fedapp")

FOLDER = "uploads"
UP, DOWN = "up", "down"


@dataclass(frozen=True)
class KeptUpload:
    phase: str
    partition: int
    replies: int  # replies with arrays this client sent in the phase; the kept one is the last
    up: dict[str, dict[str, torch.Tensor]]  # record -> array name -> tensor
    down: dict[str, dict[str, torch.Tensor]]


def _flat(side: str, content: RecordDict | None) -> dict[str, torch.Tensor]:
    if content is None:
        return {}
    return {f"{side}/{rec}/{name}": torch.from_numpy(arr.numpy().copy()).contiguous()
            for rec, record in content.array_records.items() for name, arr in record.items()}


def keep_upload(out: RunDir, phase: str, partition: int, up: RecordDict, down: RecordDict | None,
                counts: dict[tuple[str, int], int]) -> None:
    """Write one client's reply (and the message it answered) if it carries arrays; `counts` (phase,
    partition) -> replies kept so far, the caller's, updated here."""
    if not up.array_records:
        return
    from safetensors.torch import save

    key = (phase, partition)
    counts[key] = counts.get(key, 0) + 1
    try:
        tensors = {**_flat(UP, up), **_flat(DOWN, down)}
        meta = {"phase": phase, "partition": str(partition), "replies": str(counts[key])}
        atomic_write_bytes(out.path(FOLDER, phase, f"client-{partition}.safetensors"), save(tensors, metadata=meta))
    except (OSError, ValueError, TypeError, RuntimeError) as err:  # an unreadable array: the run goes on
        log.warning("[%s] upload of client %d not kept (%s: %s)", phase, partition, type(err).__name__, err)


def _nest(tensors: dict[str, torch.Tensor], side: str) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        s, rec, name = key.split("/", 2)
        if s == side:
            out.setdefault(rec, {})[name] = t
    return out


def load_uploads(run_dir: str | Path, phase: str) -> dict[int, KeptUpload]:
    """partition id -> the kept upload of `phase` in a finished run's folder ({} when none was kept)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = {}
    for path in sorted((Path(run_dir) / FOLDER / phase).glob("client-*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata()
        tensors = load_file(str(path))
        pid = int(meta["partition"])
        out[pid] = KeptUpload(phase, pid, int(meta["replies"]), _nest(tensors, UP), _nest(tensors, DOWN))
    return out


def kept_phases(run_dir: str | Path) -> list[str]:
    """The phases whose uploads a run kept."""
    root = Path(run_dir) / FOLDER
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
