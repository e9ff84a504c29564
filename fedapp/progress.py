"""Lines an operator can follow: fedapp's logger and the progress of long client phases.

Client code logs through the "fedapp" logger like the server does. Under `flwr run` a Ray actor's
stderr is forwarded to the driver, so these lines join Flower's log stream (`flwr log <run-id>`),
e.g. `client 2: condition steps 120/400, 31 s`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from typing import Iterable, Iterator, TypeVar

log = logging.getLogger("fedapp")
T = TypeVar("T")

# Which client this thread works for: set once by the ClientApp's dispatcher, so that the plain torch
# functions below the handlers need no extra argument to label their progress lines.
_CLIENT: contextvars.ContextVar[int | None] = contextvars.ContextVar("fedapp_client", default=None)

# At most one line per this share of the work or per this many seconds (whichever comes first),
# plus the last one: ~10 lines for a phase, and a sign of life for a slow one.
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


@contextlib.contextmanager
def client_scope(partition_id: int) -> Iterator[None]:
    """Label the progress lines of the work done inside with `client <partition_id>`."""
    token = _CLIENT.set(partition_id)
    try:
        yield
    finally:
        _CLIENT.reset(token)


def track(items: Iterable[T], what: str, total: int | None = None) -> Iterator[T]:
    """Yield `items` and log `client K: <what> i/total, S s` at a modest rate (see EVERY_*)."""
    total = len(items) if total is None else total  # type: ignore[arg-type]
    client = _CLIENT.get()
    prefix = f"client {client}: " if client is not None else ""
    step = max(1, int(total * EVERY_FRACTION))
    t0 = last_t = time.monotonic()
    last_i = 0
    for i, item in enumerate(items, start=1):
        yield item
        now = time.monotonic()
        if i == total or i - last_i >= step or now - last_t >= EVERY_SECONDS:
            log.info("%s%s %d/%d, %.0f s", prefix, what, i, total, now - t0)
            last_i, last_t = i, now
