"""Reading one training run at several step counts (a budget sweep), so that the sweep's checkpoints are
points of the run a table would train, not restarts of its optimiser."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

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
