"""The one gate every reply passes before the server uses it.

`keep_valid` checks each reply of a phase, in this order, and drops it with the first reason it fails:

1. the partition it claims is the one the server holds for its node (fedapp.server.grid records the
   first valid claim per node; a reply that never passed the grid names no known partition);
2. exactly the phase's records (Phase.up, plus CLIENT_KEY);
3. its METRICS_KEY record: exactly the phase's metric keys where the phase fixes them
   (Phase.metrics), every value a finite number;
4. `num-examples`: a whole number > 0 and at most what the client's shard holds (Phase.examples:
   its train or test split). The shard is a pure function of the run config and the partition id,
   so the server knows its size without asking (`shard_facts`, computed once per partition);
5. the protocol's validator (array keys, shapes, dtypes, finite values, size, consistency, bounds);
6. the phase's own bound against that shard (Phase.bound: class counts, labels, pair counts).

Each rejection is recorded once, with the node and the reason. Nothing here raises on a malformed
reply: a check that throws is itself a rejection. The phase goes on while `min-clients` valid replies
remain; only replies that passed reach an aggregation (Flower's included, whose consistency check
therefore never sees an inconsistent reply).
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any, Callable, Iterable

import numpy as np
from flwr.app import Message, RecordDict

from fedapp.protocols import CLIENT_KEY, METRICS_KEY, NUM_EXAMPLES_KEY, Phase, ShardFacts
from fedapp.protocols.records import claimed_partition
from fedapp.server.run import ServerRun

Validator = Callable[[RecordDict], "str | None"]


def check_records(content: RecordDict, phase: Phase) -> str | None:
    """The reply carries exactly the phase's records (plus CLIENT_KEY)."""
    got = set(content.keys()) - {CLIENT_KEY}
    if got != set(phase.up):
        return f"records {sorted(got)} != expected {sorted(phase.up)}"
    return None


def check_metrics(content: RecordDict, phase: Phase) -> str | None:
    """Exactly the phase's metric keys (where it fixes them), each a finite number."""
    if METRICS_KEY not in phase.up:
        return None
    rec = content.metric_records.get(METRICS_KEY)
    if rec is None:
        return f"{METRICS_KEY!r} is not a MetricRecord"
    if phase.metrics is not None and set(rec.keys()) != set(phase.metrics):
        missing = sorted(set(phase.metrics) - set(rec.keys()))
        extra = sorted(set(rec.keys()) - set(phase.metrics))
        return f"metric keys: missing {missing}, unexpected {extra}"
    for key, value in rec.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"metric {key}={value!r}: must be a finite number"
    return None


def check_examples(content: RecordDict, phase: Phase, facts: ShardFacts) -> str | None:
    """num-examples: a whole number > 0, at most the shard's split the phase counts; 0 only where the
    server knows that split is empty (an honest client of a small shard: 1,000 clients on digits leave
    most test splits empty), so no client can zero a weighted mean's denominator by claiming 0."""
    rec = content.metric_records.get(METRICS_KEY)
    if rec is None or NUM_EXAMPLES_KEY not in rec:
        return None
    n, cap = rec[NUM_EXAMPLES_KEY], facts.examples(phase.examples)
    if cap == 0 and n == 0 and not isinstance(n, bool):
        return None
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n <= 0 or n != int(n):
        return f"{NUM_EXAMPLES_KEY}={n!r}: must be a positive whole number"
    if n > cap:
        return (f"{NUM_EXAMPLES_KEY}={n!r}: exceeds the {cap} {phase.examples} examples of partition "
                f"{facts.partition}'s shard")
    return None


@functools.lru_cache(maxsize=64)
def _shard_facts(key: str, partition: int, num_partitions: int) -> ShardFacts:
    from fedapp.data import client_shard

    cfg = _ShardKey(**json.loads(key))
    shard = client_shard(cfg, partition, num_partitions)
    attrs = {k: v.numpy().astype(np.int64) for k, v in shard.train.attrs.items()}
    return ShardFacts(partition=partition, num_train=len(shard.train), num_test=len(shard.test),
                      num_classes=shard.info.num_classes, labels=shard.train.y.numpy().astype(np.int64),
                      attrs=attrs, attr_sizes={k: len(v) for k, v in shard.info.attributes.items()})


class _ShardKey:
    """The part of a run config a shard depends on (fedapp.data.client_shard reads these fields)."""

    def __init__(self, dataset: str, partitioner: str, partitioner_params: dict, seed: int, image_size: int):
        self.dataset, self.partitioner, self.partitioner_params = dataset, partitioner, partitioner_params
        self.seed, self.image_size = seed, image_size


def shard_facts(cfg: Any, partition: int, num_partitions: int) -> ShardFacts:
    """What the server knows of partition `partition`'s shard (sizes, labels, attributes); computed
    once per run config and partition, then cached."""
    key = json.dumps({"dataset": cfg.dataset, "partitioner": cfg.partitioner,
                      "partitioner_params": cfg.partitioner_params, "seed": cfg.seed,
                      "image_size": cfg.image_size}, sort_keys=True)
    return _shard_facts(key, int(partition), int(num_partitions))


def check_reply(run: ServerRun, reply: Message, phase: Phase, validate: Validator) -> str | None:
    """Why `reply` fails the gate (steps 1-6 of the module doc), or None."""
    node = reply.metadata.src_node_id
    pid, claimed = run.node_partition.get(node), claimed_partition(reply.content)
    if pid is None or run.num_partitions is None:
        return f"partition-id={claimed!r}: not a partition the server holds for node {node}"
    if isinstance(claimed, bool) or not isinstance(claimed, int) or claimed != pid:
        return f"partition-id={claimed!r}: node {node} serves partition {pid}"
    why = check_records(reply.content, phase) or check_metrics(reply.content, phase)
    if why is not None:
        return why
    facts = shard_facts(run.cfg, pid, run.num_partitions)
    why = check_examples(reply.content, phase, facts) or validate(reply.content)
    if why is None and phase.bound is not None:  # after the validator: the upload's schema holds
        why = phase.bound(reply.content, facts)
    return why


def safe_reason(check: Callable[[], "str | None"]) -> str | None:
    try:
        return check()
    except Exception as err:  # a malformed upload must not take the run down
        return f"malformed upload ({type(err).__name__}: {str(err)[:200]})"


def passing(run: ServerRun, replies: Iterable[Message], phase: Phase, validate: Validator) -> list[Message]:
    """The replies of `phase` that pass the gate (error replies are left out: MeteredGrid recorded
    them); each rejection recorded with its node and reason. Never raises."""
    kept = []
    for r in replies:
        if r.has_error():
            continue  # already recorded by MeteredGrid
        reason = safe_reason(lambda: check_reply(run, r, phase, validate))
        if reason is not None:
            run.fail(r.metadata.src_node_id, phase.name, f"invalid upload: {reason}")
            continue
        kept.append(r)
    return kept


def keep_valid(run: ServerRun, replies: Iterable[Message], phase: Phase, validate: Validator) -> list[Message]:
    """`passing`, in partition order; raises only when fewer than min-clients valid replies remain."""
    kept = passing(run, replies, phase, validate)
    if len(kept) < run.cfg.min_clients:
        raise RuntimeError(f"[{phase.name}] only {len(kept)} valid replies, fewer than "
                           f"min-clients={run.cfg.min_clients}; see failures")
    # partition order, not arrival order: an aggregation's float sum then does not depend on which
    # node or Ray actor answered first, so a run on a cluster matches the run on one machine
    return sorted(kept, key=lambda r: run.node_partition.get(r.metadata.src_node_id, -1))
