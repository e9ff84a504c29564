"""The server runtime (fedapp/server, fedapp/protocols/records.py): upload validation and byte
accounting, no simulation needed."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedapp.config import parse_run_config
from fedapp.results import RunDir
from fedapp.protocols import Phase
from fedapp.protocols.records import check_arrays, record_nbytes
from fedapp.server import MeteredGrid, ServerRun, keep_valid
from fedapp.server.grid import claim_partition
from strategies.fedavg import FedAvgStrategy


pytestmark = pytest.mark.usefixtures("inside_a_run")


def _reply(node: int, arrays: dict, n: int = 10) -> Message:
    content = RecordDict({"arrays": ArrayRecord(arrays),
                          "metrics": MetricRecord({"num-examples": n, "train_loss": 1.0, "train_ce": 1.0}),
                          "client": ConfigRecord({"partition-id": node})})
    reply = Message(content, dst_node_id=0, message_type="train")
    reply.metadata._src_node_id = node  # as the SuperLink sets it on a reply
    return reply


def _claimed(run: ServerRun, replies: list, num_partitions: int = 5) -> list:
    """What MeteredGrid does before a strategy sees the replies: each node's partition claim recorded."""
    run.num_partitions = num_partitions
    for r in replies:
        assert claim_partition(run, r.metadata.src_node_id, r.content, live=set()) is None
    return replies


def test_check_arrays_catches_nan_shape_keys_and_size():
    good = ArrayRecord({"w": torch.zeros(2, 3)})
    assert check_arrays(good, {"w": (2, 3)}) is None
    assert "non-finite" in check_arrays(ArrayRecord({"w": torch.full((2, 3), float("nan"))}), {"w": (2, 3)})
    assert "shape" in check_arrays(ArrayRecord({"w": torch.zeros(3, 2)}), {"w": (2, 3)})
    assert "wrong keys" in check_arrays(ArrayRecord({"v": torch.zeros(2, 3)}), {"w": (2, 3)})
    assert "exceeds" in check_arrays(good, {"w": (2, 3)}, max_bytes=8)
    assert check_arrays(ArrayRecord({"w": torch.zeros(5, 3)}), {"w": (None, 3)}) is None


def test_nan_and_misshaped_uploads_are_dropped_not_aggregated(tmp_path):
    cfg = parse_run_config({"min-clients": 1, "out-dir": str(tmp_path)})
    run = ServerRun(cfg=cfg, out=RunDir(tmp_path / "r"))
    strat = FedAvgStrategy(run)
    strat._expected = {"w": (2,)}
    replies = _claimed(run, [
        _reply(1, {"w": torch.tensor([1.0, 1.0])}),
        _reply(2, {"w": torch.tensor([3.0, 3.0])}),
        _reply(3, {"w": torch.tensor([float("nan"), 0.0])}),
        _reply(4, {"w": torch.zeros(3)}),
    ])
    arrays, _ = strat.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), [2.0, 2.0])  # mean of the two good ones
    dropped = {f["node_id"]: f["reason"] for f in run.failures}
    assert set(dropped) == {3, 4}
    assert "non-finite" in dropped[3] and "shape" in dropped[4]


class _FakeGrid:
    def __init__(self, fail_node=None):
        self.fail_node = fail_node

    def get_node_ids(self):
        return [1, 2]

    def send_and_receive(self, messages, timeout=None):
        out = []
        for m in messages:
            if m.metadata.dst_node_id == self.fail_node:
                continue  # never answers
            r = _reply(m.metadata.dst_node_id, {"w": torch.zeros(4)})
            out.append(r)
        return out


def test_metered_grid_counts_bytes_and_records_missing_replies(tmp_path):
    cfg = parse_run_config({"min-clients": 1})
    run = ServerRun(cfg=cfg, out=RunDir(tmp_path / "r"))
    grid = MeteredGrid(_FakeGrid(fail_node=2), run)
    msgs = [Message(RecordDict({"arrays": ArrayRecord({"w": torch.zeros(8)})}), dst_node_id=n,
                    message_type="train") for n in (1, 2)]
    replies = grid.send_and_receive(msgs, timeout=1)
    assert len(replies) == 1
    comm = run.comm()
    one = record_nbytes(msgs[0].content)
    assert comm["per_client"]["1"]["down_bytes"] == one and comm["per_client"]["1"]["up_bytes"] > 16
    assert comm["down_bytes"] == 2 * one and "2" not in comm["per_client"] or comm["per_client"]["2"]["up_bytes"] == 0
    assert run.failures[0]["node_id"] == 2 and "no reply" in run.failures[0]["reason"]


class _LinkState:
    """Push and pull as Flower's in-memory grid offers them: a pushed message gets an id, and each pull hands in
    the reply of the oldest answered message it asks for (the nodes in `silent` never answer). Records the most
    messages it held at once and the nodes in the order their messages came."""

    def __init__(self, nodes=range(50), silent=()):
        self.nodes, self.silent, self.held, self.most, self.order = list(nodes), set(silent), {}, 0, []

    def get_node_ids(self):
        return self.nodes

    def push_messages(self, messages):
        ids = []
        for m in messages:
            ids.append(f"m{len(self.order)}")
            m.metadata.__dict__["_message_id"] = ids[-1]
            self.held[ids[-1]] = m
            self.order.append(m.metadata.dst_node_id)
        self.most = max(self.most, len(self.held))
        return ids

    def pull_messages(self, ids):
        ready = [i for i in ids if i in self.held and self.held[i].metadata.dst_node_id not in self.silent][:1]
        return [Message(RecordDict({"client": ConfigRecord({"partition-id": self.held[i].metadata.dst_node_id})}),
                        reply_to=self.held.pop(i)) for i in ready]

    def send_and_receive(self, messages, timeout=None):
        raise AssertionError("a simulation's grid is sent a window at a time, never everything at once")


def _queries(nodes):
    return [Message(RecordDict({"c": ConfigRecord({"x": 1})}), dst_node_id=n, message_type="query") for n in nodes]


def test_a_window_of_messages_awaits_replies_at_a_time_and_every_reply_comes_back():
    from fedapp.server.grid import send_windowed

    state = _LinkState()
    replies = send_windowed(state, _queries(range(50)), window=4, poll=0)
    assert state.order == list(range(50)) and state.most == 4  # the next message goes out as a reply comes in
    assert sorted(r.content.config_records["client"]["partition-id"] for r in replies) == list(range(50))


def test_a_silent_node_holds_one_place_of_the_window_until_the_timeout():
    from fedapp.server.grid import send_windowed

    state = _LinkState(range(6), silent={2})
    replies = send_windowed(state, _queries(range(6)), window=2, timeout=0.3, poll=0.01)
    assert sorted(r.content.config_records["client"]["partition-id"] for r in replies) == [0, 1, 3, 4, 5]


def test_the_window_keeps_a_sweep_of_the_simulations_link_state_bounded_with_two_per_cpu_at_least(monkeypatch):
    import ray

    from fedapp.server.grid import SCAN_CHECKS, simulation_window

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    assert simulation_window(1000) == SCAN_CHECKS // 1000 and simulation_window(10) == SCAN_CHECKS // 10
    assert simulation_window(100_000) == 4  # one message at work and one waiting for each of 2 actors
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0})
    assert simulation_window(1000) == 128


def test_the_metered_grid_sends_a_simulation_a_window_at_a_time(tmp_path, monkeypatch):
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    from fedapp.server import grid as grids

    class SimulationGrid(_LinkState, InMemoryGrid):  # Flower's class, the fake's link state
        pass

    monkeypatch.setattr(grids, "simulation_window", lambda n: 3)
    sim = SimulationGrid()
    run = ServerRun(cfg=parse_run_config({"min-clients": 1}), out=RunDir(tmp_path / "r"))
    replies = MeteredGrid(sim, run).send_and_receive(_queries(range(50)))
    assert len(replies) == 50 and sim.most == 3 and run.failures == []
    assert grids.in_simulation(sim) and not grids.in_simulation(_LinkState())


def test_record_nbytes_counts_serialised_tensors_and_config_values():
    def size(n):
        return record_nbytes(RecordDict({"a": ArrayRecord({"w": torch.zeros(n)}),
                                         "c": ConfigRecord({"k": b"1234"})}))

    assert size(1010) - size(10) == 4000  # float32 payload counted byte for byte
    assert 40 + 5 <= size(10) <= 40 + 5 + 256  # plus a bounded serialisation header
    # config records by Flower's own rule, which raises on an empty string value (Flower 1.42); ours counts it
    from fedapp.protocols.records import config_nbytes

    rec = ConfigRecord({"name": "abc", "n": 3, "flag": True, "xs": [1.0, 2.0], "tags": ["a", "bc"], "raw": b"12"})
    assert config_nbytes(rec) == rec.count_bytes() == 4 + 3 + 1 + 8 + 4 + 1 + 2 + 16 + 4 + 3 + 3 + 2
    with pytest.raises(ValueError):
        ConfigRecord({"empty": ""}).count_bytes()
    assert config_nbytes(ConfigRecord({"empty": ""})) == 5


def test_validation_never_raises_and_checks_the_phase_records(tmp_path):
    """A validator that throws on a malformed upload rejects it; a reply with records the phase does not
    declare is rejected before the validator sees it."""
    cfg = parse_run_config({"min-clients": 1})
    run = ServerRun(cfg=cfg, out=RunDir(tmp_path / "r"))
    phase = Phase("train", down=("arrays",), up=("arrays", "metrics"))
    good, extra, boom = _claimed(run, [_reply(n, {"w": torch.zeros(2)}) for n in (1, 2, 3)])
    extra.content["smuggled"] = ConfigRecord({"x": 1})

    def validate(content):
        if content.config_records["client"]["partition-id"] == 3:
            raise KeyError("no such array")
        return None

    kept = keep_valid(run, [good, extra, boom], phase, validate)
    assert [r.metadata.src_node_id for r in kept] == [1]
    reasons = {f["node_id"]: f["reason"] for f in run.failures}
    assert "records" in reasons[2] and "smuggled" in reasons[2]
    assert "malformed upload (KeyError" in reasons[3]
    two = ServerRun(cfg=parse_run_config({"min-clients": 2}), out=run.out)
    with pytest.raises(RuntimeError, match="min-clients=2"):
        keep_valid(two, _claimed(two, [good]), phase, validate)


def test_check_arrays_rejects_unreadable_bytes():
    rec = ArrayRecord({"w": torch.zeros(2)})
    rec["w"].data = b"not an npy file"
    assert "unreadable" in check_arrays(rec, {"w": (2,)})


def test_summary_says_running_from_the_start_then_failed_with_the_reason(tmp_path):
    """A run that stops before its first phase leaves a summary that says so, not only config.json."""
    import json

    from fedapp.server_app import run_server

    seen = {}

    class _GoneGrid:
        def get_node_ids(self):
            summary = next(tmp_path.glob("*/summary.json"))
            seen["status"] = json.loads(summary.read_text())["status"]
            raise ConnectionError("SuperLink went away")

    with pytest.raises(ConnectionError):
        run_server(_GoneGrid(), {"method": "fedavg", "out-dir": str(tmp_path), "run-name": "r"})
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert seen["status"] == "running"
    assert summary["status"] == "failed" and summary["error"] == "ConnectionError: SuperLink went away"
    assert summary["failures"] == [] and "wall_seconds" in summary


def test_a_node_that_died_is_recorded_once_under_its_own_id(tmp_path):
    """Flower answers for a dead node itself: the error reply's src_node_id is the SuperLink's. The
    grid attributes a reply by the message it answers, so the failure is the dead node's, recorded
    once as unavailable and not also as a timeout."""
    from flwr.app import Error
    from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

    class _OneDies:
        def get_node_ids(self):
            return [7, 8]

        def send_and_receive(self, messages, timeout=None):
            for i, m in enumerate(messages):  # what Flower's push does to the sent messages
                m.metadata._message_id = f"msg-{i}"
            alive = _reply(8, {"w": torch.zeros(2)})
            alive.metadata._reply_to_message_id = "msg-1"
            alive.content["client"] = ConfigRecord({"partition-id": 1})
            dead = Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="Node Unavailable"), reply_to=messages[0])
            dead.metadata._src_node_id = SUPERLINK_NODE_ID  # the SuperLink wrote it, not node 7
            return [alive, dead]

    run = ServerRun(cfg=parse_run_config({"min-clients": 1}), out=RunDir(tmp_path / "r"))
    grid = MeteredGrid(_OneDies(), run)
    msgs = [Message(RecordDict({"arrays": ArrayRecord({"w": torch.zeros(2)})}), dst_node_id=n, message_type="train")
            for n in (7, 8)]
    grid.send_and_receive(msgs, timeout=3600)
    assert [(f["node_id"], f["phase"]) for f in run.failures] == [(7, "train")]
    assert "node unavailable after" in run.failures[0]["reason"]


def test_a_node_that_split_the_data_another_way_is_refused(tmp_path):
    """A SuperNode started with another num-partitions holds another shard than the server knows of."""
    from fedapp.server.grid import claim_partition

    run = ServerRun(cfg=parse_run_config({"min-clients": 1}), out=RunDir(tmp_path / "r"))
    run.num_partitions = 3
    ok = RecordDict({"client": ConfigRecord({"partition-id": 0, "num-partitions": 3})})
    other = RecordDict({"client": ConfigRecord({"partition-id": 1, "num-partitions": 2})})
    assert claim_partition(run, 10, ok, live=set()) is None and run.node_partition == {10: 0}
    why = claim_partition(run, 11, other, live=set())
    assert why.startswith("num-partitions=2: the run has 3 nodes") and 11 not in run.node_partition


class _Nodes:
    def __init__(self, n):
        self.ids = list(range(100, 100 + n))

    def get_node_ids(self):
        return list(self.ids)


def test_fraction_train_samples_that_share_of_nodes_reproducibly(tmp_path):
    def sampled(seed, rnd, fraction=0.5):
        cfg = parse_run_config({"min-clients": 2, "fraction-train": fraction, "seed": seed, "out-dir": str(tmp_path)})
        strat = FedAvgStrategy(ServerRun(cfg=cfg, out=RunDir(tmp_path / "r")))
        msgs = strat.configure_train(rnd, ArrayRecord({"w": torch.zeros(2)}), ConfigRecord({}), _Nodes(10))
        return sorted(m.metadata.dst_node_id for m in msgs)

    first = sampled(0, 1)
    assert len(first) == 5 and set(first) <= set(range(100, 110))  # Flower's FedAvg: int(10 * 0.5)
    assert sampled(0, 1) == first  # same seed and round: the same nodes
    assert len({tuple(sampled(0, r)) for r in range(1, 6)}) > 1  # rounds draw anew
    assert sampled(1, 1) != first or sampled(1, 2) != sampled(0, 2)
    assert len(sampled(0, 1, fraction=0.1)) == 2  # never fewer than min-clients
    assert len(sampled(0, 1, fraction=1.0)) == 10


def test_fraction_evaluate_asks_that_share_of_nodes_or_none(tmp_path):
    def asked(fraction, rnd=1):
        cfg = parse_run_config({"min-clients": 2, "fraction-evaluate": fraction, "out-dir": str(tmp_path)})
        strat = FedAvgStrategy(ServerRun(cfg=cfg, out=RunDir(tmp_path / "r")))
        msgs = strat.configure_evaluate(rnd, ArrayRecord({"w": torch.zeros(2)}), ConfigRecord({}), _Nodes(10))
        return sorted(m.metadata.dst_node_id for m in msgs)

    assert len(asked(0.3)) == 3 and asked(0.3) == asked(0.3)  # Flower's int(10 * 0.3), seeded per round
    assert len({tuple(asked(0.3, r)) for r in range(1, 6)}) > 1
    assert len(asked(0.1)) == 2 and len(asked(1.0)) == 10  # never fewer than min-clients
    assert asked(0.0) == []  # the global test set only


def test_evaluate_every_asks_the_clients_in_every_nth_round_and_the_last_only(tmp_path):
    cfg = parse_run_config({"min-clients": 2, "evaluate-every": 3, "num-server-rounds": 7, "out-dir": str(tmp_path)})
    strat = FedAvgStrategy(ServerRun(cfg=cfg, out=RunDir(tmp_path / "r")))
    asked = [r for r in range(1, 8)
             if strat.configure_evaluate(r, ArrayRecord({"w": torch.zeros(2)}), ConfigRecord({}), _Nodes(4))]
    assert asked == [3, 6, 7]
    strat.round_offset = 5  # a run resumed after round 5: Flower's round 1 is the run's round 6
    assert strat.configure_evaluate(1, ArrayRecord({"w": torch.zeros(2)}), ConfigRecord({}), _Nodes(4))
    strat._client_acc = {0: {"accuracy": 1.0, "n": 1, "domain": None}}
    assert strat.aggregate_evaluate(2, []) is None and strat._client_acc == {}  # a skipped round carries none


def test_no_federated_evaluation_is_the_protocol_not_a_warning(tmp_path, monkeypatch):
    """fraction-evaluate = 0 (fedavg-ddpm, dpdm, fedflow always; the FedAvg family on request): evaluation is
    skipped as Flower skips it, without Flower's construction-time WARNING in every such run's log."""
    import flwr.serverapp.strategy.fedavg as flower_fedavg

    logged = []
    monkeypatch.setattr(flower_fedavg, "log", lambda level, msg, *a: logged.append(msg % a if a else msg))
    cfg = parse_run_config({"min-clients": 2, "fraction-evaluate": 0.0, "out-dir": str(tmp_path)})
    strat = FedAvgStrategy(ServerRun(cfg=cfg, out=RunDir(tmp_path / "r")))
    assert strat.fraction_evaluate == 0.0 and strat.min_evaluate_nodes == 0
    assert not any("fraction_evaluate" in m for m in logged), logged


def test_fraction_train_is_refused_where_no_client_sampling_exists(tmp_path):
    from fedapp.config import ConfigError
    from fedapp.preflight import check_fraction_train

    check_fraction_train(parse_run_config({"method": "feddifrc", "fraction-train": 0.5}))
    with pytest.raises(ConfigError, match="fraction-train=0.5: method='espresso' trains every client"):
        check_fraction_train(parse_run_config({"method": "espresso", "fraction-train": 0.5}))
    with pytest.raises(ConfigError, match="fraction-evaluate=0.5: method='pfdm' evaluates every client"):
        check_fraction_train(parse_run_config({"method": "pfdm", "fraction-evaluate": 0.5}))
    with pytest.raises(ConfigError, match=r"fraction-train=0.0: must be in \(0, 1\]"):
        parse_run_config({"fraction-train": 0.0})


def test_sample_size_check_passes_a_share_of_at_least_min_clients_and_any_method_without_sampling():
    from fedapp.config import ConfigError
    from fedapp.preflight import check_sample_size

    check_sample_size(parse_run_config({"method": "fedavg", "fraction-train": 0.5, "min-clients": 5}), 10)
    check_sample_size(parse_run_config({"method": "fedavg", "fraction-evaluate": 0.0, "min-clients": 10}), 10)
    check_sample_size(parse_run_config({"method": "fedavg", "min-clients": 10}), 10)  # 1.0: every node
    with pytest.raises(ConfigError, match=r"^fraction-train=0.5: .* = 4 .*min-clients=5"):
        check_sample_size(parse_run_config({"method": "feddifrc", "fraction-train": 0.5, "min-clients": 5}), 9)
    check_sample_size(parse_run_config({"method": "espresso", "min-clients": 10}), 10)  # asks every node anyway


def test_a_client_with_an_empty_test_split_may_report_zero_examples_and_no_other():
    from fedapp.protocols import METRICS_KEY, NUM_EXAMPLES_KEY, ShardFacts, classify
    from fedapp.server.validation import check_examples

    def facts(num_test):
        return ShardFacts(partition=0, num_train=3, num_test=num_test, num_classes=10, labels=np.zeros(3, np.int64))

    def reply(n):
        return RecordDict({METRICS_KEY: MetricRecord({NUM_EXAMPLES_KEY: n})})

    assert check_examples(reply(0), classify.EVALUATE, facts(0)) is None
    assert "must be a positive whole number" in check_examples(reply(0), classify.EVALUATE, facts(2))
    assert "must be a positive whole number" in check_examples(reply(0), classify.TRAIN, facts(0))  # 3 to train on


@pytest.mark.usefixtures("inside_a_run", "one_torch_thread")
def test_fedavg_over_clients_without_test_data_completes_without_failures(tmp_path):
    """100 clients on digits: 18 have an empty test split; they are neither failures nor weighted in."""
    from fedapp.simulation import simulate_in_process

    s = simulate_in_process({"method": "fedavg", "dataset": "digits", "partitioner.name": "iid",
                             "partitioner.per-class": 0, "num-server-rounds": 1, "local-epochs": 1, "min-clients": 2,
                             "fraction-train": 0.03, "out-dir": str(tmp_path)}, 100)
    assert s["status"] == "completed" and s["failures"] == []
    assert len(s["metrics"]["per_client_accuracy"]) == 82


@pytest.mark.usefixtures("inside_a_run", "one_torch_thread")
def test_fraction_evaluate_zero_runs_rounds_with_the_global_test_set_only(tmp_path):
    from fedapp.simulation import simulate_in_process

    s = simulate_in_process({"method": "fedavg", "dataset": "digits", "partitioner.name": "iid",
                             "partitioner.per-class": 3, "num-server-rounds": 2, "local-epochs": 1, "min-clients": 2,
                             "fraction-evaluate": 0.0, "out-dir": str(tmp_path)}, 3)
    assert s["status"] == "completed" and s["failures"] == [] and "evaluate" not in s["phase_seconds"]
    assert "accuracy" in s["metrics"] and "client_accuracy" not in s["metrics"]


def test_a_resumed_runs_comm_adds_the_stopped_parts_counts_and_keeps_compute_seconds_an_older_checkpoint_lacks(
        tmp_path):
    from fedapp.server.checkpoint import Checkpoint

    earlier = {"per_client": {"0": {"up_bytes": 10, "down_bytes": 20, "messages_up": 1, "messages_down": 1}}}
    run = ServerRun(cfg=parse_run_config({"out-dir": str(tmp_path)}), out=RunDir(tmp_path / "r"),
                    resume_from=Checkpoint(round=1, state={}, progress=earlier))
    run.node_partition[7] = 0
    run.ledger.add("7", "train", "up", 5)
    run.ledger.add_seconds("7", "train", 2.5)
    comm = run.comm()
    assert comm["per_client"]["0"]["up_bytes"] == 15 and comm["per_client"]["0"]["messages_up"] == 2
    assert comm["per_client"]["0"]["compute_seconds"] == 2.5 and comm["compute_seconds"] == 2.5
