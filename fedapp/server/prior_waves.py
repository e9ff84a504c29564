"""Getting a prior to every node once per machine, not once per client.

The server names the prior by its digest and asks every node whether it holds it; the weights go to a
wave of the nodes that lack it, then the rest are asked again — a node keeps what it received in its
prior cache (keyed by the digest, `fedapp.models.prior.shipping`), which every virtual client on that
machine shares — and the next wave is twice as large. A machine is thus sent the weights about once:
in a Ray simulation all actors of a machine share its disk, so the prior crosses once per machine; in a
deployment each SuperNode downloads it once (waves of 1, 2, 4, … nodes, log2(N) + 1 rounds of questions).
The waves' overshoot is what bounds the bytes: at most 2 × its size × the machines that lack it.
Where every node is a machine of its own (a deployment), the re-asking buys nothing: `waves=False` sends
the weights to every node that lacks them at once, after one round of questions (`espresso.ship-prior=all`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

Answers = Callable[[list[int]], dict[int, bool]]  # nodes -> {node: holds the prior} for the valid replies


@dataclass
class WaveLog:
    holders: list[int] = field(default_factory=list)  # nodes that hold the prior at the end
    sent_to: list[int] = field(default_factory=list)  # nodes the weights went to, in order
    questions: int = 0  # rounds of asking
    lost: list[int] = field(default_factory=list)  # nodes that gave no valid answer (the gate recorded why)
    refused: list[int] = field(default_factory=list)  # nodes sent the weights that still lack the prior


def distribute(nodes: Iterable[int], ask: Answers, send: Answers, waves: bool = True) -> WaveLog:
    """`ask(nodes)`: do these nodes hold the prior (digest only down); `send(nodes)`: the weights down, and
    whether each then holds it. Returns who holds it, who was sent it, and who did not get it. `waves=False`:
    one wave of every node that lacks it."""
    out, pending, wave = WaveLog(), list(nodes), 1
    while pending:
        has = ask(pending)
        out.questions += 1
        out.holders += [n for n in pending if has.get(n) is True]
        out.lost += [n for n in pending if n not in has]
        lacking = [n for n in pending if has.get(n) is False]
        if not lacking:
            break
        size = wave if waves else len(lacking)
        batch, pending = lacking[:size], lacking[size:]
        got = send(batch)
        out.sent_to += batch
        out.holders += [n for n in batch if got.get(n) is True]
        out.refused += [n for n in batch if got.get(n) is False]
        out.lost += [n for n in batch if n not in got]
        wave *= 2
    return out
