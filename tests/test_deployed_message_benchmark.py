"""benchmarks/deployed_message.py hands its cold processes the server's messages as Flower's protobuf: they must
arrive as the train messages of rounds 1.. with the resolved run config and the same weights."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import deployed_message as bench  # noqa: E402

from fedapp.protocols import ARRAYS_KEY, ROUND_KEY, RUN_KEY  # noqa: E402


def test_the_written_messages_read_back_as_the_rounds_train_messages(tmp_path, inside_a_run):
    path = tmp_path / "messages.bin"
    bench.write_messages(path, 3)
    msgs = bench.read_messages(path)
    assert [m.metadata.message_type for m in msgs] == ["train"] * 3
    assert [m.content.config_records[RUN_KEY][ROUND_KEY] for m in msgs] == [1, 2, 3]
    run = msgs[0].content.config_records[RUN_KEY]
    assert (run["method"], run["dataset"], run["partitioner.name"]) == ("fedavg", "digits", "iid")
    first, last = (m.content.array_records[ARRAYS_KEY].to_torch_state_dict() for m in (msgs[0], msgs[-1]))
    assert first.keys() == last.keys() and all(torch.equal(first[k], last[k]) for k in first)
