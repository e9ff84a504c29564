"""One client against the server: every way found to crash a run or steer it is stopped by
the validation gate (fedapp/server/validation.py, fedapp/server/grid.py's partition claims).

Each case runs FedAvg on digits in process (3 clients, min-clients 2, 1 round, 1 local epoch); the
attacker is the last node, and its reply is rewritten after its honest client produced it. Each
asserts that the run completes, that the attacker and only the attacker is recorded in `failures`
(node, phase, reason, once per reply), and that the global model is exactly Flower's num-examples
weighted mean of the honest uploads (for an attack on the evaluate reply: of all three train uploads,
while the attacker's accuracy is left out). Espresso's cases compare the synthetic set with that of the
same run with the attacker's reply dropped.
"""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedapp.config import parse_run_config
from fedapp.protocols import (ACCURACY_KEY, ARRAYS_KEY, CLIENT_KEY, METRICS_KEY, NUM_EXAMPLES_KEY, PARTITION_KEY,
                              Phase)
from fedapp.protocols import espresso as E
from fedapp.results import RunDir
from fedapp.server import ServerRun, keep_valid
from fedapp.server.grid import claim_partition, client_seconds
from fedapp.server_app import run_server
from fedapp.simulation import InProcessGrid, ReplyCache, resolve_run_config
from strategies.fedavg import FedAvgStrategy

pytestmark = pytest.mark.usefixtures("inside_a_run", "one_torch_thread")

N = 3  # nodes 1000, 1001 honest; 1002 the attacker
FIRST = InProcessGrid.FIRST_NODE_ID
HONEST, ATTACKER = (FIRST, FIRST + 1), FIRST + 2
FEDAVG = {"method": "fedavg", "dataset": "digits", "partitioner.name": "iid", "num-server-rounds": 1,
          "local-epochs": 1, "min-clients": 2}


@pytest.fixture(scope="module")
def cache():
    """The honest clients' work, done once for all cases (a client is a function of its message)."""
    return ReplyCache()


class AttackGrid(InProcessGrid):
    """The in-process grid; `attack(content, grid)` rewrites the attacker's replies of `phases` after
    its honest client produced them (`drop`: the reply becomes an error instead). Keeps a copy of every
    honest reply and the global model each evaluate message carries."""

    def __init__(self, attack=None, phases=("train",), drop=False, reply_cache=None):
        super().__init__(N, reply_cache=reply_cache)
        self.attack, self.phases, self.drop = attack, phases, drop
        self.honest: dict[str, dict[int, RecordDict]] = {}
        self.global_arrays = None

    def deliver(self, msg):
        reply = super().deliver(msg)
        mtype, node = msg.metadata.message_type, msg.metadata.dst_node_id
        if mtype == "evaluate":
            self.global_arrays = copy.deepcopy(msg.content.array_records[ARRAYS_KEY])
        if reply.has_content():
            self.honest.setdefault(mtype, {})[node] = copy.deepcopy(reply.content)
        if node == ATTACKER and mtype in self.phases:
            if self.drop:
                return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="dropped"), reply_to=msg)
            self.attack(reply.content, self)
        return reply


def run(tmp_path, grid, name="r", **cfg):
    flat, _ = resolve_run_config({**FEDAVG, "out-dir": str(tmp_path), "run-name": name, **cfg}, N)
    return run_server(grid, flat)


def weighted_mean(contents: list[RecordDict]) -> ArrayRecord:
    """Flower's FedAvg of these train replies (num-examples weighted), in node order."""
    return aggregate_arrayrecords([RecordDict({ARRAYS_KEY: c.array_records[ARRAYS_KEY],
                                               METRICS_KEY: c.metric_records[METRICS_KEY]}) for c in contents],
                                  NUM_EXAMPLES_KEY)


# ---- the attacks: each rewrites one reply's content --------------------------------------------------
def _arrays(c):
    return c.array_records[ARRAYS_KEY]


def _metrics(c):
    return c.metric_records[METRICS_KEY]


def malformed_npy(c, g):
    _arrays(c)[next(iter(_arrays(c)))].data = b"\x93NUMPY not an array"


def object_dtype(c, g):
    buf = io.BytesIO()
    np.save(buf, np.array([1, "a"], dtype=object), allow_pickle=True)
    rec = _arrays(c)
    rec[next(iter(rec))] = Array(dtype="object", shape=(2,), stype="numpy.ndarray", data=buf.getvalue())


def extra_record(c, g):
    c["smuggled"] = ConfigRecord({"x": 1})


def extra_metric(c, g):
    _metrics(c)["smuggled"] = 1.0


def missing_num_examples(c, g):
    del _metrics(c)[NUM_EXAMPLES_KEY]


def weights_sum_to_zero(c, g):
    _metrics(c)[NUM_EXAMPLES_KEY] = -sum(_metrics(g.honest["train"][n])[NUM_EXAMPLES_KEY] for n in HONEST)


def non_integer_partition(c, g):
    c.config_records[CLIENT_KEY][PARTITION_KEY] = 1.5


def evaluate_without_metrics(c, g):
    del c[METRICS_KEY]


def num_examples(value):
    def attack(c, g):
        _metrics(c)[NUM_EXAMPLES_KEY] = value
    return attack


def integer_upload(c, g):
    rec = _arrays(c)
    for k in list(rec):
        a = rec[k].numpy()
        if a.dtype.kind == "f":
            rec[k] = Array(np.round(a * 1e6).astype(np.int64))


def same_partition_as_node_0(c, g):
    c.config_records[CLIENT_KEY][PARTITION_KEY] = 0


def nan_accuracy(c, g):
    _metrics(c)[ACCURACY_KEY] = float("nan")


P = pytest.param
CRASH = [  # (attack, phases rewritten, phase recorded, reason)
    P(malformed_npy, ("train",), "train", "unreadable array", id="malformed-npy-bytes"),
    P(object_dtype, ("train",), "train", "unreadable array", id="object-dtype-array"),
    P(extra_record, ("train",), "train", "records ['arrays', 'metrics', 'smuggled']", id="extra-record-key"),
    P(extra_metric, ("train",), "train", "unexpected ['smuggled']", id="extra-metric-key"),
    P(missing_num_examples, ("train",), "train", "missing ['num-examples']", id="missing-num-examples"),
    P(weights_sum_to_zero, ("train",), "train", "must be a positive whole number", id="weights-sum-to-zero"),
    P(non_integer_partition, ("train", "evaluate"), "train", "partition-id=1.5: must be an integer",
      id="non-integer-partition-id"),
    P(evaluate_without_metrics, ("evaluate",), "evaluate", "records [] != expected ['metrics']",
      id="evaluate-without-metrics"),
]
STEER = [
    P(num_examples(float("nan")), ("train",), "train", "metric num-examples=nan: must be a finite number",
      id="num-examples-nan"),
    P(num_examples(float("inf")), ("train",), "train", "metric num-examples=inf: must be a finite number",
      id="num-examples-inf"),
    P(num_examples(1e9), ("train",), "train", "num-examples=1000000000.0: exceeds the", id="num-examples-1e9"),
    P(num_examples(-5), ("train",), "train", "num-examples=-5: must be a positive whole number",
      id="num-examples-negative"),
    P(integer_upload, ("train",), "train", "dtype int64 != expected float32", id="integer-upload"),
    P(same_partition_as_node_0, ("train", "evaluate"), "train", f"partition-id=0: already served by node {FIRST}",
      id="two-nodes-one-partition"),
    P(nan_accuracy, ("evaluate",), "evaluate", "metric accuracy=nan: must be a finite number", id="nan-accuracy"),
    P(num_examples(0), ("evaluate",), "evaluate", "num-examples=0: must be a positive whole number",
      id="zero-examples-of-a-nonempty-test-split"),
]


@pytest.mark.parametrize("attack, phases, phase, reason", CRASH + STEER)
def test_one_client_can_neither_crash_nor_steer_fedavg(tmp_path, cache, attack, phases, phase, reason):
    grid = AttackGrid(attack, phases, reply_cache=cache)
    summary = run(tmp_path, grid)
    assert summary["status"] == "completed"
    # the attacker, and only the attacker, once per rewritten reply, with the reason
    assert {f["node_id"] for f in summary["failures"]} == {ATTACKER}
    assert sorted(f["phase"] for f in summary["failures"]) == sorted(phases)
    mine = [f for f in summary["failures"] if f["phase"] == phase]
    assert len(mine) == 1 and reason in mine[0]["reason"], mine
    # the global model: Flower's weighted mean of the honest uploads, bit for bit
    uploads = [grid.honest["train"][n] for n in (HONEST if "train" in phases else (*HONEST, ATTACKER))]
    expected = weighted_mean(uploads)
    assert set(grid.global_arrays) == set(expected)
    for k in expected:
        np.testing.assert_array_equal(grid.global_arrays[k].numpy(), expected[k].numpy())
    assert set(summary["metrics"]["per_client_accuracy"]) == ({"0", "1"} if "evaluate" in phases else {"0", "1", "2"})


# ---- Espresso: counts and GMM within bounds ----------------------------------------------------------
ESPRESSO = {"dataset": "digit-styles", "partitioner.name": "domain", "partitioner.per-class": 2,
            "espresso.embed-steps": 3, "espresso.steps": 3, "espresso.ratio": 1.0, "espresso.mixup-pairs": 8,
            "espresso.diffusions-per-latent": 2, "espresso.embed-batch": 8, "server-epochs": 1,
            "espresso.save-synthetic": True}


@pytest.fixture(scope="module")
def prior_dir(tmp_path_factory):
    from fedapp.models.prior.tiny import TEST_CONFIG, random_tiny_prior

    prior = random_tiny_prior(TEST_CONFIG, dataset="digit-styles", seed=0)
    return str(prior.save_pretrained(tmp_path_factory.mktemp("prior") / "tiny-random"))


def _upload(c):
    return c.array_records[E.UPLOAD_KEY]


def class_count_1e9(c, g):
    counts = _upload(c)["class_counts"].numpy().copy()
    counts[int(np.flatnonzero(counts)[0])] = 10**9
    _upload(c)["class_counts"] = Array(counts)


def gmm_variance_1e30(c, g):
    var = _upload(c)["gmm_variances"].numpy().copy()
    var[0, 0, 0] = 1e30
    _upload(c)["gmm_variances"] = Array(var)


@pytest.mark.parametrize("method, extra, attack, reason", [
    ("prompts", {}, class_count_1e9, "class_counts[0]=1000000000 exceeds the 2 the client's shard holds"),
    ("espresso", {"espresso.conditions": "prompts"}, gmm_variance_1e30,
     f"gmm_variances: max 1e+30 exceeds {E.GMM_MAX_VARIANCE:g}"),
])
def test_espresso_counts_and_gmm_beyond_their_bounds_are_dropped(tmp_path, cache, prior_dir, method, extra,
                                                                  attack, reason):
    from safetensors.torch import load_file

    cfg = {**ESPRESSO, "method": method, "prior": prior_dir, **extra}
    attacked = run(tmp_path, AttackGrid(attack, reply_cache=cache), "attacked", **cfg)
    assert attacked["status"] == "completed"
    assert [(f["node_id"], f["phase"]) for f in attacked["failures"]] == [(ATTACKER, "train")]
    assert reason in attacked["failures"][0]["reason"]
    honest_only = run(tmp_path, AttackGrid(drop=True, reply_cache=cache), "honest-only", **cfg)
    assert sorted(attacked["metrics"]["upload_bytes_per_client"]) == ["0", "1"]
    assert attacked["metrics"]["num_synthetic"] == honest_only["metrics"]["num_synthetic"] == 2 * 20
    a, h = (load_file(str(tmp_path / name / E.SYNTHETIC_FILE)) for name in ("attacked", "honest-only"))
    for k in ("x", "y", "client"):
        assert torch.equal(a[k], h[k]), k
    assert attacked["metrics"]["accuracy"] == honest_only["metrics"]["accuracy"]


# ---- partition claims ---------------------------------------------------------------------------------
def _content(pid, **client):
    return RecordDict({CLIENT_KEY: ConfigRecord({PARTITION_KEY: pid, **client})})


def test_partition_claims_first_claim_holds_no_two_live_nodes_share_one_and_a_rejoin_takes_over(tmp_path):
    run_ = ServerRun(cfg=parse_run_config({}), out=RunDir(tmp_path / "r"), num_partitions=3)
    live = {1, 2, 3}
    assert claim_partition(run_, 1, _content(0), live) is None
    assert claim_partition(run_, 2, _content(1), live) is None
    assert claim_partition(run_, 1, _content(0), live) is None  # the same claim again
    assert "this node serves partition 0" in claim_partition(run_, 1, _content(2), live)
    assert "already served by node 1" in claim_partition(run_, 3, _content(0), live)
    assert "must be in [0, 3)" in claim_partition(run_, 3, _content(3), live)
    assert "must be in [0, 3)" in claim_partition(run_, 3, _content(-1), live)
    assert "must be an integer" in claim_partition(run_, 3, _content(True), live)
    assert "must be an integer" in claim_partition(run_, 3, _content("2"), live)
    assert "unexpected keys ['x']" in claim_partition(run_, 3, _content(2, x=1), live)
    assert "no 'client' record" in claim_partition(run_, 3, RecordDict(), live)
    assert claim_partition(run_, 2, _content(1, seconds=1.5), live) is None  # its compute time rides along
    assert run_.node_partition == {1: 0, 2: 1}
    # node 1 left the grid; a node rejoining under a new id takes partition 0 over
    assert claim_partition(run_, 4, _content(0), {2, 3, 4}) is None and run_.node_partition[4] == 0


def test_a_replys_reported_seconds_count_only_as_a_finite_non_negative_number():
    assert client_seconds(_content(0, seconds=2.5)) == 2.5 and client_seconds(_content(0, seconds=3)) == 3.0
    for bad in (-1.0, float("nan"), float("inf"), True, "9", b"9"):
        assert client_seconds(_content(0, seconds=bad)) == 0.0, bad
    assert client_seconds(_content(0)) == 0.0 and client_seconds(RecordDict()) == 0.0


def test_a_reply_whose_partition_the_grid_never_accepted_fails_the_gate(tmp_path):
    run_ = ServerRun(cfg=parse_run_config({"min-clients": 1, "dataset": "digits", "partitioner.name": "iid"}),
                     out=RunDir(tmp_path / "r"), num_partitions=2)
    phase = Phase("train", down=(), up=(METRICS_KEY,), metrics=(NUM_EXAMPLES_KEY,))

    def reply(node, pid, n):
        r = Message(RecordDict({METRICS_KEY: MetricRecord({NUM_EXAMPLES_KEY: n}), **_content(pid)}),
                    dst_node_id=0, message_type="train")
        r.metadata._src_node_id = node
        return r

    claim_partition(run_, 7, _content(1), set())
    kept = keep_valid(run_, [reply(7, 1, 10), reply(8, 0, 10), reply(7, 0, 10)], phase, lambda c: None)
    assert [r.metadata.src_node_id for r in kept] == [7]
    reasons = [f["reason"] for f in run_.failures]
    assert "not a partition the server holds for node 8" in reasons[0]
    assert "node 7 serves partition 1" in reasons[1]


# ---- robust aggregation ---------------------------------------------------------------------------------
def _upload_reply(node, w, n=10):
    r = Message(RecordDict({ARRAYS_KEY: ArrayRecord({"w": torch.tensor(w)}),
                            METRICS_KEY: MetricRecord({NUM_EXAMPLES_KEY: n, "train_loss": 1.0, "train_ce": 1.0}),
                            **_content(node)}), dst_node_id=0, message_type="train")
    r.metadata._src_node_id = node
    return r


UPLOADS = [([1.0, 2.0], 10), ([3.0, 4.0], 20), ([3.0, 5.0], 10), ([4.0, 4.0], 10), ([500.0, 600.0], 10)]


@pytest.mark.parametrize("aggregation, expected", [
    ("mean", [(10 + 60 + 30 + 40 + 5000) / 60, (20 + 80 + 50 + 40 + 6000) / 60]),  # weighted by num-examples
    ("median", [3.0, 4.0]),
    ("trimmed-mean", [(3 + 3 + 4) / 3, (4 + 4 + 5) / 3]),  # Flower's beta 0.2: one of five cut at each end
    ("krum", [3.0, 4.0]),  # the upload nearest its n - 2 = 3 neighbours
])
def test_aggregation_picks_flowers_strategy_for_the_fedavg_family(tmp_path, aggregation, expected):
    """A finite but extreme upload passes the gate; median, trimmed mean and Krum keep it out of the model."""
    cfg = parse_run_config({"min-clients": 1, "aggregation": aggregation, "dataset": "digits",
                            "partitioner.name": "iid"})
    run_ = ServerRun(cfg=cfg, out=RunDir(tmp_path / "r"), num_partitions=len(UPLOADS))
    strat = FedAvgStrategy(run_)
    strat._expected, strat._dtypes = {"w": (2,)}, {"w": "float32"}
    replies = [_upload_reply(i, w, n) for i, (w, n) in enumerate(UPLOADS)]
    for r in replies:
        claim_partition(run_, r.metadata.src_node_id, r.content, set())
    arrays, _ = strat.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), expected, rtol=1e-6)
    assert run_.failures == []


def test_aggregation_is_a_checked_config_choice():
    from fedapp.config import ConfigError

    with pytest.raises(ConfigError,
                       match="aggregation='mode': must be one of 'mean', 'median', 'trimmed-mean', 'krum'"):
        parse_run_config({"aggregation": "mode"})
