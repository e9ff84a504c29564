"""Reading one training run at several step counts (a budget sweep), so that the sweep's checkpoints are
points of the run a table would train, not restarts of its optimiser; and the train states that let a run
stopped mid-training continue where it was cut (TrainState, and run_train_state for a named run's folder)."""

from __future__ import annotations

import io
import logging
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedapp.results import atomic_write_bytes

log = logging.getLogger("fedapp")
STATE_DIR = "train_state"  # a run folder's train states (removed when the run completes)
# run-config keys that change where a run writes or how often it saves, not what it computes: a run whose
# config differs only in these continues from the same train states
STATE_FREE_KEYS = ("run-name", "out-dir", "resume", "log.tensorboard", "device", "pfdm.checkpoint-every")

OnCheckpoint = Callable[[int, nn.Module, float], None]


class Checkpoints:
    """on_checkpoint(k, model, loss) after step k of `at`: the model to read in eval mode (training mode is
    restored on the trained one afterwards), loss the mean of the last 10% of the k steps' losses."""

    losses: list[float]

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
    data generator, the losses so far and the process's global RNGs (torch, CUDA, numpy, python). The trainer
    writes it atomically after each checkpoint's reading, every `every` steps (0: never between readings)
    and at the end (so a resumed sweep has every reading up to the step it continues from); `signature`
    (the run's settings) must match the file's, or loading names both (StaleState); restart=True: a file saved
    for other settings is removed with a warning and the training starts over instead.

    Nothing here feeds a privacy mechanism: DP noise is drawn from the OS (fedapp.privacy.os_generator,
    os_torch_generator), which no restored RNG state reaches."""

    def __init__(self, path: str | Path, signature: dict, every: int = 0, restart: bool = False):
        self.path, self.signature, self.every, self.restart = Path(path), dict(signature), int(every), restart
        self._loaded: dict | None = None  # the file as `saved_step` read it, handed to `restore` (one load)

    def saved_step(self) -> int:
        """The step the file holds (0: no usable file)."""
        state = self._read()
        return int(state["step"]) if state is not None else 0

    def due(self, step: int, steps: int, readings: Iterable[int] = ()) -> bool:
        """Whether to save after `step` (1-based) of `steps`: at a reading, every `every` steps, at the end."""
        return step == steps or step in readings or (self.every > 0 and step % self.every == 0)

    def _read(self) -> dict | None:
        if self._loaded is None and self.path.exists():
            try:
                self._loaded = load_signed(self.path, self.signature, "train state")
            except StaleState as err:
                if not self.restart:
                    raise
                log.warning("%s: starting it over", err)
                self.path.unlink(missing_ok=True)
        return self._loaded

    def restore(self, parts: dict, generator, extras: dict) -> int:
        """Load every part's state dict, the generator's state, the `extras` lists and the global RNGs in
        place; the step (0: no usable file)."""
        state, self._loaded = self._read(), None  # restored once: the memory goes back
        if state is None:
            return 0
        for name, obj in parts.items():
            if obj is not None:
                obj.load_state_dict(state["parts"][name])
        generator.set_state(state["generator"])
        for name, values in extras.items():
            values[:] = state["extras"][name]
        if "rng" in state:  # files written before the global RNGs were kept lack them
            set_rng_states(state["rng"])
        return int(state["step"])

    def save(self, step: int, parts: dict, generator, extras: dict) -> None:
        self._loaded = None
        save_signed(self.path, self.signature, {
            "step": step, "generator": generator.get_state(), "rng": rng_states(),
            "parts": {n: o.state_dict() for n, o in parts.items() if o is not None},
            "extras": {n: list(v) for n, v in extras.items()}})


def rng_states() -> dict[str, Any]:
    """The process's global RNG states: torch's CPU (and CUDA's, where initialised), numpy's, python's."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if states.get("cuda") is not None and torch.cuda.is_available() \
            and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_signed(path: Path, signature: dict, body: dict) -> None:
    """`body` with its `signature` in one file, written atomically."""
    buf = io.BytesIO()
    torch.save({**body, "signature": signature}, buf)
    atomic_write_bytes(path, buf.getvalue())


class StaleState(ValueError):
    """A state file saved for other settings than the run that reads it."""


def load_signed(path: Path, signature: dict, what: str) -> dict:
    """A save_signed file; refused (StaleState), naming both signatures, when it was saved for other settings."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["signature"] != signature:
        raise StaleState(f"{what} {path}: saved for {state['signature']}, not this run's {signature}; "
                         "remove the file to start over")
    return state


def run_state_dir(cfg) -> Path | None:
    """Where a run keeps its train states (<out-dir>/<run-name>/train_state): only a run with a fixed
    run-name (a restart finds the same folder) and a checkpoint interval (pfdm.checkpoint-every > 0);
    None otherwise. A client keeps its own there too (in a deployment: on its own disk, same path)."""
    every = getattr(cfg.options, "checkpoint_every", 0)
    if not every or not cfg.run_name:
        return None
    return Path(cfg.out_dir) / cfg.run_name / STATE_DIR


def state_signature(cfg, name: str) -> dict:
    """What a train state was saved for: its name in the run and the run config values that decide it, those
    away from their defaults (a key that a newer version adds at a default keeps the old states usable) and
    not in STATE_FREE_KEYS."""
    from fedapp.config import all_defaults
    from fedapp.models.cache import facts_digest

    defaults = all_defaults()
    flat = {k: v for k, v in cfg.flat().items()
            if k not in STATE_FREE_KEYS and (k not in defaults or defaults[k] != v)}
    return {"name": name, "config": facts_digest(flat, 16)}


def run_train_state(cfg, name: str) -> TrainState | None:
    """The TrainState `name` (e.g. "client0-private") of a run, saved every pfdm.checkpoint-every steps;
    None where the run keeps none (run_state_dir). One saved for another config is started over, with a
    warning: a run (a client's especially, whose error would only drop it) never fails on a stale file."""
    folder = run_state_dir(cfg)
    if folder is None:
        return None
    return TrainState(folder / f"{name}.pt", state_signature(cfg, name), every=cfg.options.checkpoint_every,
                      restart=True)


def kept_tensors(cfg, name: str, draw: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`draw()` once per run: where the run keeps train states, its result is saved under `name` and a
    restarted run gets the saved tensors back instead of a second draw (a client's local-DP upload: sending
    the same release again spends no more privacy; a fresh draw would release the data twice). Tensors
    saved for another config are drawn again, with a warning."""
    folder = run_state_dir(cfg)
    path = None if folder is None else folder / f"{name}.pt"
    if path is not None and path.exists():
        try:
            return load_signed(path, state_signature(cfg, name), "kept tensors")["tensors"]
        except StaleState as err:
            log.warning("%s: drawing them again", err)
    tensors = draw()
    if path is not None:
        save_signed(path, state_signature(cfg, name), {"tensors": tensors})
    return tensors


def drop_train_states(run_dir: str | Path) -> None:
    """A completed run's train states: nothing is left to continue, so they go (they weigh ~4x its models)."""
    import shutil

    shutil.rmtree(Path(run_dir) / STATE_DIR, ignore_errors=True)
