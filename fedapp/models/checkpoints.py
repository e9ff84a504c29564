"""Reading one training run at several step counts (a budget sweep), so that the sweep's checkpoints are
points of the run a table would train, not restarts of its optimiser."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from fedapp.results import atomic_write_bytes

OnCheckpoint = Callable[[int, nn.Module, float], None]


class Checkpoints:
    """on_checkpoint(k, model, loss) after step k of `at`: the model to read in eval mode (training mode is
    restored on the trained one afterwards), loss the mean of the last 10% of the k steps' losses."""

    def __init__(self, at: Iterable[int] = (), on_checkpoint: OnCheckpoint | None = None):
        self.at = set(at) if on_checkpoint is not None else set()
        self.on_checkpoint, self.losses = on_checkpoint, []

    def step(self, k: int, loss: float, read: nn.Module, trained: nn.Module) -> None:
        """After step k (1-based): `read` is what the run would end with here (an EMA, or `trained` itself)."""
        if not self.at:
            return
        self.losses.append(float(loss))
        if k in self.at:
            n = max(1, k // 10)
            read.eval()
            self.on_checkpoint(k, read, sum(self.losses[-n:]) / n)
            trained.train()


class TrainState:
    """A trainer's whole state in one file, so that a run longer than a session continues where it was cut
    and ends with the weights an uninterrupted run ends with: the step, the net, its EMA, the optimiser, the
    data generator and the losses so far. The trainer writes it atomically after each checkpoint's reading
    and at the end (so a resumed sweep has every reading up to the step it continues from); `signature`
    (the run's settings) must match the file's, or loading names both."""

    def __init__(self, path: str | Path, signature: dict):
        self.path, self.signature = Path(path), dict(signature)
        self._loaded: dict | None = None  # the file as `saved_step` read it, handed to `restore` (one load)

    def saved_step(self) -> int:
        """The step the file holds (0: no file)."""
        return int(self._read()["step"]) if self.path.exists() else 0

    def _read(self) -> dict:
        if self._loaded is None:
            state = torch.load(self.path, map_location="cpu", weights_only=False)
            if state["signature"] != self.signature:
                raise ValueError(f"train state {self.path}: saved for {state['signature']}, not this run's "
                                 f"{self.signature}; remove the file to start over")
            self._loaded = state
        return self._loaded

    def restore(self, parts: dict, generator, extras: dict) -> int:
        """Load every part's state dict, the generator's state and the `extras` lists in place; the step."""
        if not self.path.exists():
            return 0
        state, self._loaded = self._read(), None  # restored once: the memory goes back
        for name, obj in parts.items():
            if obj is not None:
                obj.load_state_dict(state["parts"][name])
        generator.set_state(state["generator"])
        for name, values in extras.items():
            values[:] = state["extras"][name]
        return int(state["step"])

    def save(self, step: int, parts: dict, generator, extras: dict) -> None:
        self._loaded = None
        buf = io.BytesIO()
        torch.save({"step": step, "signature": self.signature, "generator": generator.get_state(),
                    "parts": {n: o.state_dict() for n, o in parts.items() if o is not None},
                    "extras": {n: list(v) for n, v in extras.items()}}, buf)
        atomic_write_bytes(self.path, buf.getvalue())
