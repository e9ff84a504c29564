"""The FedAvg family's packed weights (fedapp.protocols.weights): exact round trips, a clear refusal of a record
that does not fit the model, a message of a few Flower objects whatever the depth, the validation gate's checks
on the packed record, and Flower's aggregators combining packed uploads exactly as per-tensor ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg, Krum
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from torch import nn

from fedapp.models.classifier import build_classifier
from fedapp.protocols import ARRAYS_KEY, CLIENT_KEY, METRICS_KEY, NUM_EXAMPLES_KEY, PARTITION_KEY, RUN_KEY
from fedapp.protocols.weights import WEIGHTS, flat_of, load_weights, pack, unpack, weights_record

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def _trained_bn_net(seed: int) -> nn.Module:
    """Random weights and BatchNorm statistics after 5 training-mode batches (num_batches_tracked = 5)."""
    torch.manual_seed(seed)
    net = _bn_net().train()
    for p in net.parameters():
        p.data.normal_()
    for _ in range(5):
        net(torch.randn(8, 1, 8, 8))
    return net


def _wire(record: ArrayRecord) -> ArrayRecord:
    """A record through Flower's protobuf, as a message carries it."""
    return recorddict_from_proto(recorddict_to_proto(RecordDict({ARRAYS_KEY: record}))).array_records[ARRAYS_KEY]


@pytest.mark.parametrize("make", [lambda: _trained_bn_net(0), lambda: build_classifier("cnn", 10)],
                         ids=["batchnorm", "default-cnn"])
def test_a_packed_model_loads_back_bit_for_bit_integer_buffers_included(make):
    sent = make()
    record = _wire(weights_record(sent.state_dict()))
    assert list(record) == [WEIGHTS] and record[WEIGHTS].dtype == "float32" and len(record[WEIGHTS].shape) == 1
    torch.manual_seed(123)  # another initialisation: every value must come from the record
    got = load_weights(_fresh_like(sent), record)
    a, b = sent.state_dict(), got.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    if "1.num_batches_tracked" in a:
        assert b["1.num_batches_tracked"].item() == 5 and b["1.num_batches_tracked"].dtype == torch.int64


def _fresh_like(model: nn.Module) -> nn.Module:
    return _bn_net() if isinstance(model, nn.Sequential) else build_classifier("cnn", 10)


def test_a_record_that_does_not_fit_the_model_is_refused_with_its_sizes():
    net = build_classifier("cnn", 10)
    n = sum(t.numel() for t in net.state_dict().values())
    short = ArrayRecord({WEIGHTS: torch.zeros(n - 1)})
    with pytest.raises(ValueError, match=rf"weights: shape \({n - 1},\); the model's 24 tensors need \({n},\)"):
        load_weights(net, short)
    with pytest.raises(ValueError, match=r"weights record holds \['features.0.0.bias', .*expected the one "
                                         r"array 'weights'"):
        load_weights(net, ArrayRecord(net.state_dict()))  # a per-tensor record
    with pytest.raises(ValueError, match=rf"weights: shape \(1, {n}\)"):
        unpack(torch.zeros(1, n), net.state_dict())


def test_packing_refuses_what_float32_cannot_hold_exactly():
    with pytest.raises(ValueError, match="w: dtype torch.float64 cannot ride as float32"):
        pack({"w": torch.zeros(2, dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"n: integer value 16777216 is not exact in float32"):
        pack({"n": torch.tensor(2 ** 24)})
    assert pack({"n": torch.tensor(2 ** 24 - 1)}).item() == 2 ** 24 - 1


def _objects(model: nn.Module, packed: bool) -> int:
    """Flower objects a FedAvg train message of `model` inflates into (what a SuperNode pulls one by one)."""
    state = model.state_dict()
    arrays = weights_record(state) if packed else ArrayRecord(state)
    msg = Message(RecordDict({RUN_KEY: ConfigRecord({"server-round": 1}), ARRAYS_KEY: arrays}), dst_node_id=1,
                  message_type="train")
    return len(get_all_nested_objects(msg))


@pytest.mark.usefixtures("inside_a_run")
def test_a_fedavg_message_is_a_few_flower_objects_whatever_the_models_depth():
    models = {"cnn-gap": build_classifier("cnn-gap", 10), "cnn": build_classifier("cnn", 10),
              "cnn + projection head": build_classifier("cnn", 10, proj_dim=64)}
    depths = {k: len(m.state_dict()) for k, m in models.items()}
    assert depths == {"cnn-gap": 22, "cnn": 24, "cnn + projection head": 28}
    packed = {k: _objects(m, True) for k, m in models.items()}
    per_tensor = {k: _objects(m, False) for k, m in models.items()}
    assert len(set(packed.values())) == 1 and packed["cnn"] <= 6, packed  # message, records, one array, one chunk
    for k, d in depths.items():
        assert per_tensor[k] >= d + packed[k], (k, per_tensor[k])  # an Array (and its chunks) per tensor


def test_the_gate_checks_length_dtype_finite_values_and_size_of_the_packed_record(tmp_path):
    from fedapp.config import parse_run_config
    from fedapp.results import RunDir
    from fedapp.server import ServerRun
    from strategies.fedavg import FedAvgStrategy

    net = build_classifier("cnn", 10)
    flat = pack(net.state_dict())
    cfg = parse_run_config({"dataset": "digits", "partitioner.name": "iid", "max-upload-mb": 2.0})
    strat = FedAvgStrategy(ServerRun(cfg=cfg, out=RunDir(tmp_path / "r"), num_partitions=2))
    strat.expect(weights_record(net.state_dict()))

    def why(arrays):
        return strat.validate_train(RecordDict({ARRAYS_KEY: arrays}))

    nan = flat.clone()
    nan[7] = float("nan")
    assert why(weights_record(net.state_dict())) is None
    assert f"weights: shape ({len(flat) - 1},) != expected ({len(flat)},)" in why(ArrayRecord({WEIGHTS: flat[1:]}))
    assert "weights: dtype float64 != expected float32" in why(ArrayRecord({WEIGHTS: flat.double()}))
    assert "weights: non-finite values" in why(ArrayRecord({WEIGHTS: nan}))
    assert "wrong keys" in why(ArrayRecord(net.state_dict()))  # a per-tensor upload
    big = parse_run_config({"dataset": "digits", "partitioner.name": "iid", "max-upload-mb": 1.0})
    capped = FedAvgStrategy(ServerRun(cfg=big, out=RunDir(tmp_path / "c"), num_partitions=2))
    capped.expect(weights_record(net.state_dict()))  # the CNN is 1.54 MiB: over a 1 MiB cap
    assert "exceeds the cap of 1048576 bytes" in capped.validate_train(RecordDict({ARRAYS_KEY: ArrayRecord(
        {WEIGHTS: flat})}))


def _reply(arrays: ArrayRecord, n: int, node: int) -> Message:
    r = Message(RecordDict({ARRAYS_KEY: arrays, METRICS_KEY: MetricRecord({NUM_EXAMPLES_KEY: n}),
                            CLIENT_KEY: ConfigRecord({PARTITION_KEY: node})}), dst_node_id=0, message_type="train")
    r.metadata._src_node_id = node
    return r


AGGREGATORS = {"mean": FedAvg, "median": FedMedian, "trimmed-mean": FedTrimmedAvg, "krum": Krum}


@pytest.mark.usefixtures("inside_a_run")
@pytest.mark.parametrize("name", list(AGGREGATORS))
def test_flowers_aggregators_combine_packed_uploads_exactly_as_per_tensor_ones(name):
    """Seven random uploads of the MOON-sized CNN (28 tensors), aggregated per tensor and packed: the same value
    at every coordinate, bit for bit. Mean, median and trimmed mean run the same float32 operations on each
    coordinate in either layout; Krum's distances are over the concatenated upload, which is the packed vector."""
    like = build_classifier("cnn", 10, proj_dim=64).state_dict()
    g = torch.Generator().manual_seed(0)
    uploads = [{k: torch.randn(t.shape, generator=g) for k, t in like.items()} for _ in range(7)]
    sizes = [int(s) for s in torch.randint(5, 50, (7,), generator=g)]

    def aggregate(make):
        strategy = AGGREGATORS[name](weighted_by_key=NUM_EXAMPLES_KEY, arrayrecord_key=ARRAYS_KEY,
                                     configrecord_key=RUN_KEY)
        arrays, _ = strategy.aggregate_train(1, [_reply(make(u), n, i) for i, (u, n) in enumerate(zip(uploads, sizes))])
        return arrays

    per_tensor = aggregate(ArrayRecord)
    packed = aggregate(weights_record)
    assert list(packed) == [WEIGHTS] and list(per_tensor) == list(like)
    expected = pack({k: torch.from_numpy(per_tensor[k].numpy()) for k in like}).numpy()
    got = flat_of(packed).numpy()
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    if name == "mean":  # and it is the num-examples-weighted mean (float32 sums against float64: ~1e-7)
        mean = sum(n * pack(u).double() for u, n in zip(uploads, sizes)) / sum(sizes)
        np.testing.assert_allclose(got, mean.numpy(), rtol=1e-5, atol=1e-6)
