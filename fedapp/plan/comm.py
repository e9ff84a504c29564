"""Bytes down and up per client, counted as the metered grid counts them (fedapp.server.grid: record_nbytes
of each message's RecordDict) from the protocol's records, built at their real shapes: the run config on
every message down, the model's ArrayRecord, an upload's arrays (zeros of the schema's shapes and dtypes),
the metrics a phase declares and the client record every reply carries.

`CommRow`: one phase and direction, bytes and messages per client over the run.
A shipped tiny prior's weights (Espresso's query.prior waves) go only to nodes that lack it: reported
beside the totals (`conditional`), not in them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CommRow:
    phase: str
    direction: str  # "down" | "up"
    bytes_by: dict[int, float] = field(default_factory=dict)  # client -> bytes over the run
    messages_by: dict[int, float] = field(default_factory=dict)  # client -> messages

    @property
    def total(self) -> float:
        return sum(self.bytes_by.values())


class Comm:
    def __init__(self, cfg, facts):
        self.cfg, self.facts = cfg, facts
        self.rows: dict[tuple[str, str], CommRow] = {}
        self.conditional: dict[str, int] = {}  # what goes only to some nodes (the shipped prior's weights)

    def add(self, phase: str, direction: str, client: int, nbytes_: float, messages: float) -> None:
        if messages <= 0:
            return
        row = self.rows.setdefault((phase, direction), CommRow(phase, direction))
        row.bytes_by[client] = row.bytes_by.get(client, 0.0) + nbytes_ * messages
        row.messages_by[client] = row.messages_by.get(client, 0.0) + messages

    def exchange(self, phase, down: dict[str, Any], up: dict[str, Any], messages: float | list[float],
                 config: dict[str, Any] | None = None, up_by_client: list[int] | None = None,
                 reads_shard: bool = True) -> None:
        """One exchange of a Phase, `messages` times per client (a list: per client): the run config
        (+ `config`'s extras) and the `down` records to the client; the `up` records (+ `up_by_client[k]`
        bytes: an upload whose size differs by client), the phase's metrics and the client record back.
        Values of `down`/`up`: records, or their byte counts. `reads_shard` False: a handler that never reads
        its shard (query.prior, query.receive), whose client record then names no domain."""
        from flwr.app import MetricRecord

        down_b = run_config_bytes(self.cfg, **(config or {})) + sum(nbytes(r) for r in down.values())
        metrics = MetricRecord({k: 0.0 for k in phase.metrics}).count_bytes() if phase.metrics else 0
        up_b = sum(nbytes(r) for r in up.values()) + metrics
        per = messages if isinstance(messages, list) else [messages] * self.facts.num_clients
        for k, m in enumerate(per):
            self.add(phase.message_type, "down", k, down_b, m)
            extra = up_by_client[k] if up_by_client else 0
            who = client_record_bytes(self.facts, k, reads_shard)
            self.add(phase.message_type, "up", k, up_b + extra + who, m)

    def per_client(self) -> dict[int, dict[str, float]]:
        out = {k: {"down": 0.0, "up": 0.0} for k in range(self.facts.num_clients)}
        for r in self.rows.values():
            for k, b in r.bytes_by.items():
                out[k][r.direction] += b
        return out


def nbytes(record) -> int:
    """A record's bytes as record_nbytes counts them (an int: already counted)."""
    from flwr.app import ConfigRecord

    from fedapp.protocols.records import config_nbytes

    if isinstance(record, int):
        return record
    return config_nbytes(record) if isinstance(record, ConfigRecord) else record.count_bytes()


def run_config_bytes(cfg, **extra: Any) -> int:
    """The RUN_KEY record of a message: the resolved flat config (run-name as the run resolves it)."""
    from fedapp.protocols.records import config_nbytes, run_config_record

    flat = cfg.flat()
    flat["run-name"] = cfg.resolved_run_name
    return config_nbytes(run_config_record(flat, **extra))


def client_record_bytes(facts, k: int, with_domain: bool = True) -> int:
    """CLIENT_KEY on every reply (fedapp.client_app): partition id, partitions, seconds, and the shard's
    domain when the handler read its shard."""
    from flwr.app import ConfigRecord

    from fedapp.protocols import DOMAIN_KEY, NUM_PARTITIONS_KEY, PARTITION_KEY, SECONDS_KEY
    from fedapp.protocols.records import config_nbytes

    who = {PARTITION_KEY: k, NUM_PARTITIONS_KEY: facts.num_clients, SECONDS_KEY: 0.0}
    if with_domain and facts.domains[k] is not None:
        who[DOMAIN_KEY] = facts.domains[k]
    return config_nbytes(ConfigRecord(who))


def arrays(tensors: dict) -> int:
    from flwr.app import ArrayRecord

    return ArrayRecord(tensors).count_bytes()
