"""The classification protocol of FedAvg (McMahan et al., 2017) and every method built on its rounds
(FedProx, MOON, FedDifRC, the centralized ceiling's evaluation).

    train     down: the global weights (ARRAYS_KEY)   up: the local weights + metrics (num-examples, train_*)
    evaluate  down: the global weights                 up: metrics (num-examples, loss, accuracy)
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from flwr.app import Message, RecordDict

from fedapp.protocols import (ACCURACY_KEY, ARRAYS_KEY, CLIENT_KEY, DOMAIN_KEY, EVAL_METRICS, EVALUATE, METRICS_KEY,
                              NUM_EXAMPLES_KEY, Phase)
from fedapp.protocols.records import check_arrays, partition_of

# Train metrics: the sample weight and the last epoch's mean losses (clients.classify.local_train's
# {loss, ce} as train_<name>); methods that add a loss term declare their own TRAIN with more.
TRAIN_LOSS, TRAIN_CE = "train_loss", "train_ce"
TRAIN_METRICS = (NUM_EXAMPLES_KEY, TRAIN_LOSS, TRAIN_CE)
TRAIN = Phase("train", down=(ARRAYS_KEY,), up=(ARRAYS_KEY, METRICS_KEY),
              doc="local epochs from the global weights; the server averages the uploads by num-examples",
              metrics=TRAIN_METRICS)
PHASES = (TRAIN, EVALUATE)


def train_phase(*extra_metrics: str) -> Phase:
    """FedAvg's train exchange for a method whose clients report more train metrics."""
    return Phase(TRAIN.message_type, down=TRAIN.down, up=TRAIN.up, doc=TRAIN.doc,
                 metrics=TRAIN_METRICS + tuple(extra_metrics))
RESUMABLE = True  # a round-based run continues from its last checkpoint (fedapp/server/checkpoint.py)


def check_num_examples(content: RecordDict) -> str | None:
    """The sample weight of a reply: a finite, positive whole number."""
    n = content.metric_records[METRICS_KEY].get(NUM_EXAMPLES_KEY)
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n <= 0 or n != int(n):
        return f"{NUM_EXAMPLES_KEY}={n!r}: must be a positive whole number"
    return None


def validate_train(content: RecordDict, expected: Mapping[str, tuple], max_bytes: float | None,
                   dtypes: Mapping[str, str] | None = None) -> str | None:
    """The global model's exact keys, shapes and (with `dtypes`) dtypes, finite, within the size cap;
    a sane weight."""
    return (check_arrays(content.array_records.get(ARRAYS_KEY), expected, max_bytes, dtypes)
            or check_num_examples(content))


def validate_evaluate(content: RecordDict) -> str | None:
    """num-examples as in train; loss finite; accuracy in [0, 1]."""
    why = check_num_examples(content)
    if why is not None:
        return why
    m = content.metric_records[METRICS_KEY]
    for key in EVAL_METRICS:
        v = m.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return f"{key}={v!r}: must be a finite number"
    if not 0.0 <= m[ACCURACY_KEY] <= 1.0:
        return f"{ACCURACY_KEY}={m[ACCURACY_KEY]!r}: must be in [0, 1]"
    return None


def client_accuracies(replies: Iterable[Message]) -> dict[int, dict[str, Any]]:
    """partition id -> {accuracy, n, domain} from validated evaluate replies."""
    out = {}
    for r in replies:
        m = r.content.metric_records[METRICS_KEY]
        pid = partition_of(r)
        domain = r.content.config_records.get(CLIENT_KEY, {}).get(DOMAIN_KEY)
        out[pid if pid is not None else -r.metadata.src_node_id] = {
            "accuracy": float(m[ACCURACY_KEY]), "n": int(m[NUM_EXAMPLES_KEY]),
            "domain": domain if isinstance(domain, str) else None}
    return out
