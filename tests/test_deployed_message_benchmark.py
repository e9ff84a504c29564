"""benchmarks/deployed_message.py hands its cold processes the server's messages as Flower's protobuf: they must
arrive as the train messages of rounds 1.. with the resolved run config and the same weights."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import deployed_message as bench  # noqa: E402

from fedapp.models.classifier import build_classifier  # noqa: E402
from fedapp.protocols import ARRAYS_KEY, ROUND_KEY, RUN_KEY  # noqa: E402
from fedapp.protocols.weights import flat_of, load_weights  # noqa: E402


def test_the_written_messages_read_back_as_the_rounds_train_messages(tmp_path, inside_a_run):
    path = tmp_path / "messages.bin"
    bench.write_messages(path, 3)
    msgs = bench.read_messages(path)
    assert [m.metadata.message_type for m in msgs] == ["train"] * 3
    assert [m.content.config_records[RUN_KEY][ROUND_KEY] for m in msgs] == [1, 2, 3]
    run = msgs[0].content.config_records[RUN_KEY]
    assert (run["method"], run["dataset"], run["partitioner.name"]) == ("fedavg", "digits", "iid")
    first, last = (flat_of(m.content.array_records[ARRAYS_KEY]) for m in (msgs[0], msgs[-1]))
    model = build_classifier("cnn", 10)
    assert torch.equal(first, last) and len(first) == sum(t.numel() for t in model.state_dict().values())
    load_weights(model, msgs[0].content.array_records[ARRAYS_KEY])  # the packed layout is the model's own
