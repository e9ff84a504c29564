"""Flower's Grid, metered: every message down and reply up is counted per client and phase, and
every failed or missing reply recorded, whether Flower's round loop or a method's phase sends it.

It also keeps the server's node-to-partition map. Flower's simulation numbers nodes at random and
deals partitions in registration order, and a deployed SuperNode names its own `partition-id`, so
the server cannot derive the map: it records each node's first valid claim and holds the node to it.
A reply whose claim is not an integer in [0, num-partitions), differs from the node's earlier claim,
or names a partition another live node (grid.get_node_ids()) already serves is dropped here, with
the reason, before anything reads it. A node that rejoins under a new id after its old id left the
grid takes its partition over."""

from __future__ import annotations

import logging
import time
from types import FrameType
from typing import Any, Callable, Iterable

from flwr.app import Message, RecordDict

from fedapp.protocols import CLIENT_KEY, DOMAIN_KEY, NUM_PARTITIONS_KEY, PARTITION_KEY, SECONDS_KEY
from fedapp.protocols.records import record_nbytes
from fedapp.server.run import ServerRun
from fedapp.server.uploads import keep_upload

log = logging.getLogger("fedapp")


class MeteredGrid:
    """A Grid proxy that counts bytes per client and phase, records failed replies and holds the
    node -> partition map (drops a reply whose claim it refuses: `claim_partition`)."""

    def __init__(self, grid: Any, run: ServerRun):
        self._grid = grid
        self.run = run
        if run.num_partitions is None:  # the nodes at the start of the run: what the strategies split data by
            run.num_partitions = len(grid.get_node_ids())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        if not messages:
            return []
        phase = messages[0].metadata.message_type
        for m in messages:
            self.run.ledger.add(str(m.metadata.dst_node_id), phase, "down", record_nbytes(m.content))
        t0 = time.time()
        with self.run.phase(phase, quiet=True):
            replies = self._exchange(messages, timeout)
        elapsed = time.time() - t0
        answered, kept = set(), []
        live = LiveNodes(self._grid)
        sender = senders(messages)
        sent = {m.metadata.dst_node_id: m.content for m in messages}
        for r in replies:
            node = sender(r)
            answered.add(node)
            if r.has_error():
                self.run.fail(node, phase, error_reason(r, elapsed))
                kept.append(r)
                continue
            self.run.ledger.add(str(node), phase, "up", record_nbytes(r.content))
            why = claim_partition(self.run, node, r.content, live)
            if why is not None:  # dropped: no strategy ever reads a reply whose sender is unknown
                self.run.fail(node, phase, f"invalid partition claim: {why}")
                continue
            self.run.ledger.add_seconds(str(node), phase, client_seconds(r.content))
            if self.run.cfg.log.uploads:  # what the privacy audit attacks (fedapp/server/uploads.py)
                keep_upload(self.run.out, phase, self.run.node_partition[node], r.content,
                            sent.get(node), self.run.kept_uploads)
            kept.append(r)
        for m in messages:
            if m.metadata.dst_node_id not in answered:
                self.run.fail(m.metadata.dst_node_id, phase, f"no reply within {timeout} s")
        ok = sum(not r.has_error() for r in kept)
        log.info("[%s] %d/%d clients replied in %.1fs", phase, ok, len(messages), time.time() - t0)
        return kept

    def _exchange(self, messages: list[Message], timeout: float | None) -> list[Message]:
        """Flower's send_and_receive; on a simulation's grid a window of messages at a time (SCAN_CHECKS)."""
        if in_simulation(self._grid):
            return send_windowed(self._grid, messages, simulation_window(self.run.num_partitions or 1), timeout)
        return list(self._grid.send_and_receive(messages, timeout=timeout))


# A Flower simulation's delivery thread asks its in-memory link state for each node's next message every 0.1 s, and
# each such ask scans every message the state holds (flwr/server/superlink/fleet/vce/vce_api.py:
# add_messages_to_queue, in_memory_linkstate.py:get_message_ins): N nodes x the messages held, every sweep. Pushed
# all at once, N clients' messages cost N^2 checks a sweep, sweeps that run for as long as the phase does and take the
# driver's CPU from the clients (1,000 clients: 10^6 checks). The window keeps a sweep near SCAN_CHECKS (~40 ms).
SCAN_CHECKS = 16_000


def simulation_window(num_nodes: int) -> int:
    """Messages to keep awaiting their reply in a simulation of `num_nodes` nodes: SCAN_CHECKS / N, and never
    fewer than two for each CPU of its Ray (an actor per CPU by default: one at work, one waiting)."""
    import ray

    cpus = int(ray.cluster_resources().get("CPU", 1)) if ray.is_initialized() else 1
    return max(2 * cpus, SCAN_CHECKS // max(1, num_nodes))


def in_simulation(grid: Any) -> bool:
    """Whether `grid` is a Flower simulation's in-memory grid (`flwr run` with a simulation federation, or
    `fedapp.simulate`): the one whose link state scans its messages per node."""
    try:
        from flwr.superlink.grid.inmemory_grid import InMemoryGrid
    except ImportError:
        return False
    return isinstance(grid, InMemoryGrid)


def send_windowed(grid: Any, messages: list[Message], window: int, timeout: float | None = None,
                  poll: float = 0.02) -> list[Message]:
    """Flower's send_and_receive, with at most `window` messages awaiting their reply at a time: the next message
    goes out as a reply comes in. The replies in the order they came; after `timeout` seconds (None: no limit)
    those not yet in, and the messages not yet sent, are left out, as Flower leaves out replies that miss it."""
    end = None if timeout is None else time.monotonic() + timeout
    queue = iter(messages)
    pending: set[str] = set()  # ids of the messages awaiting their reply
    replies: list[Message] = []
    while True:
        while len(pending) < window and (msg := next(queue, None)) is not None:
            pending.update(grid.push_messages([msg]))
        if not pending:
            return replies
        came = list(grid.pull_messages(pending))
        pending.difference_update(r.metadata.reply_to_message_id for r in came)
        replies += came
        if end is not None and time.monotonic() >= end:
            return replies
        if not came:
            time.sleep(poll)


def senders(messages: list[Message]) -> Callable[[Message], int]:
    """reply -> the node it answers for. A reply names the message it answers (reply_to_message_id);
    that is the node's own id even when the SuperLink writes the reply itself (a node that died: the
    error's src_node_id is then the SuperLink's). Unsent messages carry no ids: src_node_id then."""
    by_id = {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}
    if len(by_id) != len(messages):
        by_id = {}
    return lambda r: by_id.get(r.metadata.reply_to_message_id, r.metadata.src_node_id)


def error_reason(reply: Message, elapsed: float) -> str:
    """One line per failure: a node that left (Flower's NODE_UNAVAILABLE) or the client's own error."""
    from flwr.common.constant import ErrorCode

    if reply.error.code == ErrorCode.NODE_UNAVAILABLE:
        return f"node unavailable after {elapsed:.0f} s (missed heartbeats)"
    return f"client error: {reply.error.reason}"


class LiveNodes:
    """The grid's connected node ids, asked once per batch of replies and only when a claim needs them."""

    def __init__(self, grid: Any):
        self._grid = grid
        self._ids: set[int] | None = None

    def __contains__(self, node: int) -> bool:
        if self._ids is None:
            self._ids = set(self._grid.get_node_ids())
        return node in self._ids


def client_seconds(content: RecordDict) -> float:
    """The compute seconds a reply reports (SECONDS_KEY of CLIENT_KEY), 0.0 for anything but a finite
    non-negative number: telemetry a client sends is counted, never trusted enough to fail a reply."""
    value = content.config_records.get(CLIENT_KEY, {}).get(SECONDS_KEY)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        return 0.0
    return float(value)


def claim_partition(run: ServerRun, node: int, content: RecordDict, live: Any) -> str | None:
    """Why `node` may not serve the partition its reply claims (CLIENT_KEY), or None: then the claim
    is the node's in `run.node_partition` from now on. `live`: the connected node ids."""
    rec = content.config_records.get(CLIENT_KEY)
    if rec is None:
        return f"no {CLIENT_KEY!r} record naming the partition"
    extra = sorted(set(rec.keys()) - {PARTITION_KEY, NUM_PARTITIONS_KEY, DOMAIN_KEY, SECONDS_KEY})
    if extra:
        return f"unexpected keys {extra} in the {CLIENT_KEY!r} record"
    pid, n = rec.get(PARTITION_KEY), run.num_partitions
    if NUM_PARTITIONS_KEY in rec and rec[NUM_PARTITIONS_KEY] != n:  # its shard is another split of the data
        return (f"{NUM_PARTITIONS_KEY}={rec[NUM_PARTITIONS_KEY]!r}: the run has {n} nodes; start every "
                f"SuperNode with --node-config \"partition-id=K {NUM_PARTITIONS_KEY}={n}\"")
    if isinstance(pid, bool) or not isinstance(pid, int):
        return f"{PARTITION_KEY}={pid!r}: must be an integer"
    if n is None or not 0 <= pid < n:
        return f"{PARTITION_KEY}={pid}: must be in [0, {n}) (one partition per node of the run)"
    held = run.node_partition.get(node)
    if held is not None:
        return None if held == pid else f"{PARTITION_KEY}={pid}: this node serves partition {held}"
    other = next((o for o, p in run.node_partition.items() if p == pid and o != node and o in live), None)
    if other is not None:
        return f"{PARTITION_KEY}={pid}: already served by node {other}, which is still connected"
    run.node_partition[node] = pid
    return None


def make_messages(node_ids: Iterable[int], message_type: str,
                  content_for: Callable[[int], RecordDict]) -> list[Message]:
    """One message per node (contents may differ per node)."""
    return [Message(content=content_for(n), message_type=message_type, dst_node_id=n) for n in node_ids]


class TooFewNodes(RuntimeError):
    """Fewer nodes than min-clients connected within node-timeout: one line, no traceback needed."""


def simulated_nodes(grid: Any) -> int | None:
    """The number of SuperNodes of the Flower simulation `grid` belongs to; None for any other grid (a
    deployment's nodes join over time) or where the number cannot be read.

    A simulation's federation is fixed: flwr registers its `num-supernodes` nodes once and adds none. It starts
    the ServerApp on a thread of its own first, though, so `grid.get_node_ids()` alone cannot tell "all there"
    from "not yet registered", and flwr 1.42 hands the ServerApp no count: the Context's node_config is empty
    (flwr/server/superlink/linkstate/linkstate.py:537) and the federation config stays in flwr-simulation
    (flwr/simulation/app.py:247, 337-340). The count is read where flwr keeps it: the `num_supernodes` argument
    of `flwr.simulation.run_simulation._main_loop`, the frame that made this very grid (run_simulation.py:301)
    and runs the simulation until the ServerApp returns (`flwr run`'s flwr-simulation and
    `flwr.simulation.run_simulation` alike)."""
    import sys

    try:
        from flwr.superlink.grid.inmemory_grid import InMemoryGrid
    except ImportError:
        return None
    module = sys.modules.get("flwr.simulation.run_simulation")
    code = getattr(getattr(module, "_main_loop", None), "__code__", None)
    if not isinstance(grid, InMemoryGrid) or code is None:
        return None
    for top in sys._current_frames().values():
        frame: FrameType | None = top
        while frame is not None:
            if frame.f_code is code:
                local = frame.f_locals
                count = local.get("num_supernodes")
                if local.get("grid") is grid and isinstance(count, int) and not isinstance(count, bool):
                    return count
            frame = frame.f_back
    return None


def wait_for_nodes(grid: Any, n: int, timeout: float = 600.0, poll: float = 1.0, report: float = 10.0) -> list[int]:
    """Block until at least `n` nodes are connected (deployment nodes join over time), saying every `report`
    seconds how many are, and failing in one line (TooFewNodes) after `timeout` seconds: waiting is never
    silent."""
    t0 = last = time.time()
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= n:
            return nodes
        now = time.time()
        if now - t0 > timeout:
            raise TooFewNodes(f"min-clients={n}: only {len(nodes)} nodes connected within node-timeout="
                               f"{timeout:g} s")
        if now - last >= report:
            last = now
            log.info("waiting for %d nodes: %d connected (%.0f s of node-timeout=%g s)", n, len(nodes), now - t0,
                     timeout)
        time.sleep(poll)
