"""Lines an operator can follow: fedapp's logger and the progress of long phases.

Client code logs through the "fedapp" logger like the server does. Under `flwr run` a Ray actor's
stderr is forwarded to the driver, so these lines join Flower's log stream (`flwr log <run-id>`),
e.g. `client 2: condition steps 120/400, 31 s`. The server's long phases add an ETA
(`synthesis 1200/5000 images, 40 s, ETA 2 min`), and its rounds a line at each start and end
(`round 3/20: train on 10 of 1000 clients`, `round 3/20 done in 12.1 s, ETA 3 min`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import time
from typing import Iterable, Iterator, TypeVar

log = logging.getLogger("fedapp")
T = TypeVar("T")

# Which client this thread works for: set once by the ClientApp's dispatcher, so that the plain torch
# functions below the handlers need no extra argument to label their progress lines.
_CLIENT: contextvars.ContextVar[int | None] = contextvars.ContextVar("fedapp_client", default=None)

# A phase that ends within QUIET_SECONDS logs no progress line at all (the lines around it say it ran; four
# clients' ten `noise GMMs k/10, 0 s` lines each told nobody anything). Past that, one line per this share of
# the work or per this many seconds (whichever comes first), plus the last one: ~10 lines for a long phase,
# and a sign of life for a slow one.
QUIET_SECONDS = 5.0
EVERY_FRACTION = 0.1
EVERY_SECONDS = 10.0


def setup_logging() -> None:
    """One stderr handler on the "fedapp" logger at INFO (once per process): the server's and each
    client process' lines, not left to the root logger's default (WARNING and up only)."""
    if not log.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(levelname)s fedapp: %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


def flush_lines() -> None:
    """Push out what this process has written but not yet flushed (fedapp's handlers, stdout, stderr). A
    client calls it before its reply leaves: Ray forwards a worker's lines from what reached its log file,
    and a line still buffered when the server ends the run reaches the log after the run's end."""
    for handler in log.handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # no stream, or a closed one: nothing to push
            pass


def no_ray_log_dedup() -> bool:
    """Ray's driver prints each line of its actors as it comes, not deduplicated; True when that is so.

    Ray merges lines that differ only in their numbers across its workers: `client 2: condition steps 40/100`
    then hides `client 3: condition steps 40/100`, held back and printed later as `[repeated 3x across
    cluster]`, the last of them only when Ray shuts down, after the run's end. The deduplication happens in
    the driver (the process that runs the ServerApp under `flwr run`, or `simulate`'s), which reads
    RAY_DEDUP_LOGS when it imports Ray; Flower imported it already, so the flag Ray's logging module holds
    is switched off too. A RAY_DEDUP_LOGS the user set (e.g. RAY_DEDUP_LOGS=1 on a large cluster) wins."""
    if os.environ.get("RAY_DEDUP_LOGS", "").lower() in ("1", "true"):  # what Ray reads as on
        return False
    os.environ["RAY_DEDUP_LOGS"] = "0"  # read by Ray at import
    for name in ("ray._private.ray_constants", "ray._private.ray_logging"):  # imported: set where it is read
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "RAY_DEDUP_LOGS"):
            setattr(module, "RAY_DEDUP_LOGS", False)
    return True


@contextlib.contextmanager
def client_scope(partition_id: int) -> Iterator[None]:
    """Label the progress lines of the work done inside with `client <partition_id>`."""
    token = _CLIENT.set(partition_id)
    try:
        yield
    finally:
        _CLIENT.reset(token)


def duration(seconds: float) -> str:
    """A human span: `40 s`, `3 min`, `1.5 h`."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    """`done` of `total` units of one phase, logged as `[client K: ]<what> i/total[ unit], S s[, ETA x]`
    once the phase has run QUIET_SECONDS, then every EVERY_FRACTION of the work or EVERY_SECONDS, and at
    the end; a phase done within QUIET_SECONDS logs nothing. The ETA assumes the remaining units take as
    long as the done ones did on average."""

    def __init__(self, what: str, total: int, unit: str = "", eta: bool = False):
        client = _CLIENT.get()
        self.prefix = f"client {client}: " if client is not None else ""
        self.what, self.total, self.unit, self.eta = what, total, f" {unit}" if unit else "", eta
        self.step = max(1, int(total * EVERY_FRACTION))
        self.t0 = self.last_t = time.monotonic()
        self.done = self.last_done = 0

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        elapsed = now - self.t0
        if elapsed < QUIET_SECONDS:  # a short phase: no line, not even the last
            return
        if self.done >= self.total or self.done - self.last_done >= self.step or now - self.last_t >= EVERY_SECONDS:
            line = f"{self.prefix}{self.what} {self.done}/{self.total}{self.unit}, {elapsed:.0f} s"
            if self.eta and self.done < self.total:
                line += f", ETA {duration(elapsed / self.done * (self.total - self.done))}"
            log.info("%s", line)
            self.last_done, self.last_t = self.done, now


def track(items: Iterable[T], what: str, total: int | None = None, eta: bool = False) -> Iterator[T]:
    """Yield `items`, logging `[client K: ]<what> i/total, S s[, ETA x]` at a modest rate (Progress)."""
    progress = Progress(what, len(items) if total is None else total, eta=eta)  # type: ignore[arg-type]
    for item in items:
        yield item
        progress.advance()


class Rounds:
    """Start and end lines of a server's round loop, with the ETA of the rounds left from the mean
    round so far: `round 3/20: train on 10 of 1000 clients`, `round 3/20 done in 12.1 s, ETA 3 min`."""

    def __init__(self, total: int, first: int = 1):
        self.total, self.first = total, first
        self.t0: float | None = None  # the first round's start: the initial evaluation is no round
        self.round_t0 = 0.0

    def start(self, rnd: int, what: str) -> None:
        self.round_t0 = time.monotonic()
        self.t0 = self.round_t0 if self.t0 is None else self.t0
        log.info("round %d/%d: %s", rnd, self.total, what)

    def end(self, rnd: int) -> None:
        now = time.monotonic()
        if self.t0 is None:  # ended without a start: nothing to time
            return
        done = rnd - self.first + 1
        eta = f", ETA {duration((now - self.t0) / done * (self.total - rnd))}" if rnd < self.total else ""
        log.info("round %d/%d done in %.1f s%s", rnd, self.total, now - self.round_t0, eta)
