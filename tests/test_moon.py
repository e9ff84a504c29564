"""MOON: the model-contrastive loss, the previous local model kept in Context.state, and an
end-to-end Ray simulation."""

import math

import pytest
import torch

import fedapp
from clients import moon
from fedapp.config import all_defaults
from fedapp.protocols.moon import STATE_PREV_MODEL


def test_l_con_prefers_the_global_model_and_is_log2_when_both_coincide():
    g = torch.Generator().manual_seed(0)
    z_glob, z_prev = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    near_glob = moon.moon_contrastive(z_glob + 0.01, z_glob, z_prev, tau=0.5)
    near_prev = moon.moon_contrastive(z_prev + 0.01, z_glob, z_prev, tau=0.5)
    assert near_glob < math.log(2) < near_prev
    assert moon.moon_contrastive(torch.randn(8, 16), z_glob, z_glob, 0.5).item() == pytest.approx(math.log(2))


def test_previous_local_model_lives_in_context_state(tmp_path, monkeypatch):
    from fedapp.server_app import run_server
    from fedapp.simulation import InProcessGrid

    seen = []  # (partition-less) whether each MoonLoss had a previous model
    original = moon.MoonLoss.__init__

    def spy(self, global_model, prev_model, mu, tau):
        seen.append(prev_model is not None)
        original(self, global_model, prev_model, mu, tau)

    monkeypatch.setattr(moon.MoonLoss, "__init__", spy)
    grid = InProcessGrid(2)
    flat = {**all_defaults(), "method": "moon", "num-server-rounds": 2, "local-epochs": 1, "min-clients": 2,
            "partitioner.name": "iid", "partitioner.per-class": 3, "out-dir": str(tmp_path), "run-name": "moon"}
    s = run_server(grid, flat)
    assert s["status"] == "completed" and s["failures"] == []
    assert seen == [False, False, True, True]  # round 1: no previous model; round 2: the one from round 1
    for ctx in grid.nodes.values():
        prev = ctx.state.array_records[STATE_PREV_MODEL].to_torch_state_dict()
        assert any(k.startswith("proj.") for k in prev)


def test_moon_simulation_end_to_end(tmp_path, one_actor):
    s = fedapp.simulate({"method": "moon", "dataset": "digits", "num-server-rounds": 2, "local-epochs": 1,
                         "out-dir": str(tmp_path), "min-clients": 2, "partitioner": "iid",
                         "partitioner.per-class": 5}, num_clients=2, backend=one_actor)
    assert s["status"] == "completed" and s["failures"] == []
    assert 0.0 <= s["metrics"]["accuracy"] <= 1.0
