"""Getting a prior to every node once per machine, not once per client.

The server names the prior by its digest and asks nodes whether they hold it; the weights go to a wave of the
nodes that lack it — a node keeps what it received in its prior cache (keyed by the digest,
`fedapp.models.prior.shipping`), which every virtual client on that machine shares — and the next wave is twice
as large. A machine is thus sent the weights about once: in a Ray simulation all actors of a machine share its
disk, so the prior crosses once per machine; in a deployment each SuperNode downloads it once (waves of 1, 2, 4,
… nodes). The waves' overshoot is what bounds the bytes: at most 2 × its size × the machines that lack it.

The questions go in doubling waves too, starting with one node, and to every node not yet asked once a round
finds none that lacks it: on one machine one node is asked and sent the weights, then two are asked, then all the
others, each node once (N questions; asking every node, then re-asking the rest, would be 2N - 1 messages through
the simulation). A node that lacks it and is left out of the send wave is asked again in the next round.
Where every node is a machine of its own (a deployment), the re-asking buys nothing: `waves=False` asks every
node at once and sends the weights to every node that lacks them (`espresso.ship-prior=all`).
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
    asked: int = 0  # questions sent, over all rounds
    lost: list[int] = field(default_factory=list)  # nodes that gave no valid answer (the gate recorded why)
    refused: list[int] = field(default_factory=list)  # nodes sent the weights that still lack the prior


def distribute(nodes: Iterable[int], ask: Answers, send: Answers, waves: bool = True) -> WaveLog:
    """`ask(nodes)`: do these nodes hold the prior (digest only down); `send(nodes)`: the weights down, and
    whether each then holds it. Returns who holds it, who was sent it, and who did not get it. `waves=False`:
    one round of questions to every node, then one wave of every node that lacks it."""
    out, pending = WaveLog(), list(nodes)
    ask_size = send_size = 1
    while pending:
        batch, rest = (pending[:ask_size], pending[ask_size:]) if waves else (pending, [])
        has = ask(batch)
        out.questions += 1
        out.asked += len(batch)
        out.holders += [n for n in batch if has.get(n) is True]
        out.lost += [n for n in batch if n not in has]
        lacking = [n for n in batch if has.get(n) is False]
        wave, unsent = (lacking[:send_size], lacking[send_size:]) if waves else (lacking, [])
        if wave:
            got = send(wave)
            out.sent_to += wave
            out.holders += [n for n in wave if got.get(n) is True]
            out.refused += [n for n in wave if got.get(n) is False]
            out.lost += [n for n in wave if n not in got]
            send_size *= 2
        pending = unsent + rest
        ask_size = 2 * ask_size if lacking else len(pending)  # none lacked it: the rest most likely hold it too
    return out
