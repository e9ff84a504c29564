"""Adding a method touches its protocol, its strategy, its client, one registry line and its test.
This module is all five for a toy method ("the mean label of the federation") and runs it end to end
through fedapp.simulate: Ray actors receive the registration with the ClientApp."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from flwr.app import ArrayRecord, RecordDict

import fedapp
from fedapp import registry
from fedapp.options import opt
from fedapp.data import all_client_shards
from fedapp.protocols import Phase
from fedapp.protocols.records import check_arrays, tensors_of
from fedapp.server import PhasedStrategy

# ---- protocol (would be fedapp/protocols/toy.py) -------------------------------------------------------
COUNT_KEY = "label-count"  # ArrayRecord {sum: (1,), n: (1,)}
COUNT = Phase("query.count", down=(), up=(COUNT_KEY,), doc="each client's label sum and count")
PHASES = (COUNT,)


@dataclass(frozen=True)
class ToyOptions:
    scale: float = opt(1.0, low=0.0, help="multiplies the reported mean")


def validate_count(content: RecordDict) -> str | None:
    return check_arrays(content.array_records.get(COUNT_KEY), {"sum": (1,), "n": (1,)})


# ---- server side (would be strategies/toy.py) ----------------------------------------------------------
class ToyStrategy(PhasedStrategy):
    def execute(self, grid) -> dict:
        replies = self.exchange(grid, COUNT, sorted(grid.get_node_ids()), validate=validate_count)
        counts = [tensors_of(r.content.array_records[COUNT_KEY]) for r in replies]
        total, n = sum(float(c["sum"]) for c in counts), sum(float(c["n"]) for c in counts)
        return {"mean_label": self.run.cfg.options.scale * total / n, "clients": len(counts)}


# ---- client side (would be clients/toy.py) -------------------------------------------------------------
def handle_count(msg, ctx) -> RecordDict:
    y = ctx.shard.train.y
    return RecordDict({COUNT_KEY: ArrayRecord({"sum": y.sum().reshape(1).double(), "n": torch.tensor([len(y)])})})


HANDLERS = {COUNT.message_type: handle_count}

# ---- the registry line --------------------------------------------------------------------------------
HERE = "tests.test_add_a_method"
TOY = registry.MethodSpec(HERE, f"{HERE}:ToyStrategy", HERE, paper="a toy: the federation's mean label",
                          namespace="toy", options=f"{HERE}:ToyOptions")


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setitem(registry.METHODS, "toy", TOY)


def test_a_method_registered_from_a_test_module_runs_end_to_end(tmp_path, toy_registered):
    cfg = {"method": "toy", "toy.scale": 2.0, "dataset": "digits", "partitioner.name": "iid",
           "partitioner.per-class": 5, "min-clients": 3, "out-dir": str(tmp_path)}
    s = fedapp.simulate(cfg, num_clients=3)
    assert s["status"] == "completed" and s["failures"] == [] and s["metrics"]["clients"] == 3
    from fedapp.config import all_defaults, parse_run_config

    shards = all_client_shards(parse_run_config({**all_defaults(), **cfg}), 3)
    truth = torch.cat([sh.train.y for sh in shards]).double().mean().item()
    assert s["metrics"]["mean_label"] == pytest.approx(2.0 * truth)
    assert s["comm"]["per_client"]["0"]["messages_up"] == 1  # one exchange, metered like any method


def test_the_toy_options_are_validated_like_any_method(toy_registered):
    from fedapp.config import ConfigError, parse_run_config

    with pytest.raises(ConfigError, match=r"toy.scale=-1.0: must be >= 0"):
        parse_run_config({"method": "toy", "toy.scale": -1.0})
    assert "query.count" in registry.message_types()


def test_the_registration_travels_with_the_client_app_into_another_process(toy_registered):
    """Ray unpickles the ClientApp in its actors, whose registry lacks the method: the app re-registers it."""
    import pickle

    from fedapp.client_app import make_client_app

    blob = pickle.dumps(make_client_app())
    del registry.METHODS["toy"]  # what an actor's freshly imported registry looks like
    pickle.loads(blob)
    assert registry.METHODS["toy"] == TOY
