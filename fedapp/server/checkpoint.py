"""What a run leaves to be resumed or reused: the global model after every round
(checkpoint.safetensors + checkpoint.json, both written atomically) and the final model
(model.safetensors). `resume = "<run dir>"` continues a round-based run from its last checkpoint.
checkpoint.json also keeps what the run had spent by then (bytes per client, phase and wall seconds:
ServerRun.progress), so that a resumed run's summary counts the whole run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fedapp.results import RunDir, atomic_write_bytes

CHECKPOINT = "checkpoint.safetensors"
CHECKPOINT_META = "checkpoint.json"
FINAL_MODEL = "model.safetensors"


@dataclass(frozen=True)
class Checkpoint:
    round: int  # the last completed server round
    state: dict[str, torch.Tensor]  # the global model after it
    progress: dict  # what the run had spent by then (ServerRun.progress); {} in checkpoints written before it


def save_tensors(out: RunDir, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    """A safetensors file in the run folder, written atomically (CPU, contiguous copies)."""
    from safetensors.torch import save

    path = out.path(name)
    atomic_write_bytes(path, save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}))
    return path


def save_checkpoint(out: RunDir, server_round: int, state: dict[str, torch.Tensor],
                    progress: dict | None = None) -> None:
    """Weights first, then the round that names them: a crash between the two leaves the previous
    round's meta pointing at newer weights only if both were written, never at half a file."""
    save_tensors(out, CHECKPOINT, state)
    out.write_json(CHECKPOINT_META, {"round": int(server_round), **({"progress": progress} if progress else {})})


def save_model(out: RunDir, state: dict[str, torch.Tensor]) -> Path:
    return save_tensors(out, FINAL_MODEL, state)


def load_checkpoint(folder: str | Path) -> Checkpoint:
    from safetensors.torch import load_file

    folder = Path(folder)
    meta = json.loads((folder / CHECKPOINT_META).read_text())
    return Checkpoint(round=int(meta["round"]), state=load_file(str(folder / CHECKPOINT)),
                      progress=meta.get("progress", {}))
