"""The classification protocol of FedAvg (McMahan et al., 2017) and every method built on its rounds
(FedProx, MOON, FedDifRC, the centralized ceiling's evaluation).

    train     down: the global weights (ARRAYS_KEY)   up: the local weights + metrics (num-examples, train_*)
    evaluate  down: the global weights                 up: metrics (num-examples, loss, accuracy)

The weights travel packed: one flat float32 Array in the ARRAYS_KEY record (fedapp.protocols.weights), laid
out by the model both sides build from the run config.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from flwr.app import Message, RecordDict

from fedapp.protocols import (ACCURACY_KEY, ARRAYS_KEY, CLIENT_KEY, DOMAIN_KEY, EVALUATE, METRICS_KEY,
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


def validate_train(content: RecordDict, expected: Mapping[str, tuple], max_bytes: float | None,
                   dtypes: Mapping[str, str] | None = None) -> str | None:
    """The global model's exact keys, shapes and (with `dtypes`) dtypes, finite, within the size cap: for the
    packed record (fedapp.protocols.weights), its one array's length, float32, finite values and size.
    (num-examples and the metric keys are the gate's: fedapp.server.validation checks them first.)"""
    return check_arrays(content.array_records.get(ARRAYS_KEY), expected, max_bytes, dtypes)


def validate_evaluate(content: RecordDict) -> str | None:
    """Accuracy in [0, 1]. (The gate has already checked the exact metric keys, that each is a finite
    number, and num-examples against the client's test split.)"""
    acc = content.metric_records[METRICS_KEY][ACCURACY_KEY]
    if not 0.0 <= acc <= 1.0:
        return f"{ACCURACY_KEY}={acc!r}: must be in [0, 1]"
    return None


def client_accuracies(replies: Iterable[Message]) -> dict[int, dict[str, Any]]:
    """partition id -> {accuracy, n, domain} from validated evaluate replies; a client without test
    data (n = 0, which validation allows only for an empty split) has no accuracy and is left out."""
    out = {}
    for r in replies:
        m = r.content.metric_records[METRICS_KEY]
        if int(m[NUM_EXAMPLES_KEY]) == 0:
            continue
        pid = partition_of(r)
        domain = r.content.config_records.get(CLIENT_KEY, {}).get(DOMAIN_KEY)
        out[pid if pid is not None else -r.metadata.src_node_id] = {
            "accuracy": float(m[ACCURACY_KEY]), "n": int(m[NUM_EXAMPLES_KEY]),
            "domain": domain if isinstance(domain, str) else None}
    return out
