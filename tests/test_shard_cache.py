"""A client's shard kept on its node's disk (fedapp.shard_cache): the same shard back, a fresh process that
reads it without rendering or partitioning, and a file per data config."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedapp import data, shard_cache
from fedapp.config import parse_run_config

ROOT = Path(__file__).resolve().parents[1]
CFG = {"method": "fedavg", "dataset": "digits", "partitioner.name": "iid", "partitioner.per-class": 3}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(shard_cache.CACHE_ENV, str(tmp_path / "shards"))
    monkeypatch.setattr(shard_cache, "_BUILT_HERE", set())  # as a fresh process: nothing rendered yet
    return tmp_path / "shards"


def _same(a, b) -> bool:
    splits = [(a.train, b.train), (a.test, b.test)]
    return (all(torch.equal(s.x, t.x) and torch.equal(s.y, t.y) and s.attrs.keys() == t.attrs.keys()
                and all(torch.equal(s.attrs[k], t.attrs[k]) for k in s.attrs)
                and torch.equal(s.index, t.index) and torch.equal(s.source, t.source) for s, t in splits)
            and a.info == b.info and json.loads(json.dumps(a.meta)) == b.meta)


def test_a_kept_shard_reads_back_as_the_shard_built_from_the_config(cache):
    cfg = parse_run_config(CFG)
    built = data.client_shard(cfg, 1, 3)
    path = shard_cache.shard_path(cfg, 1, 3)
    shard_cache.write_shard(path, built)
    assert path.parent == cache and _same(built, shard_cache.read_shard(path))
    names = {shard_cache.shard_path(parse_run_config({**CFG, **kw}), pid, n).name
             for kw, pid, n in [({}, 1, 3), ({}, 0, 3), ({}, 1, 4), ({"seed": 1}, 1, 3),
                                ({"partitioner.per-class": 4}, 1, 3), ({"dataset": "digit-styles"}, 1, 3)]}
    assert len(names) == 6  # every data argument names its own file


def test_the_first_shard_of_a_process_is_kept_and_later_ones_come_from_memory(cache, monkeypatch):
    cfg = parse_run_config(CFG)
    first = shard_cache.client_shard(cfg, 0, 3)
    assert [p.name for p in cache.iterdir()] == [shard_cache.shard_path(cfg, 0, 3).name]
    assert _same(first, data.client_shard(cfg, 0, 3))
    shard_cache.client_shard(cfg, 2, 3)  # the dataset is rendered in this process now: no disk
    assert len(list(cache.iterdir())) == 1
    monkeypatch.setattr(shard_cache, "_BUILT_HERE", set())
    shard_cache.shard_path(cfg, 0, 3).write_bytes(b"not a safetensors file")  # damaged: built again, kept again
    assert _same(shard_cache.client_shard(cfg, 0, 3), first)
    assert _same(shard_cache.read_shard(shard_cache.shard_path(cfg, 0, 3)), first)


def test_a_fresh_process_reads_the_kept_shard_without_rendering_or_partitioning(cache):
    """What a deployed ClientApp's next message gets: the shard, and none of the data packages imported."""
    script = (
        "import json, sys, torch\n"
        "from fedapp.config import parse_run_config\n"
        "from fedapp.shard_cache import client_shard\n"
        f"s = client_shard(parse_run_config({CFG!r}), 1, 3)\n"
        "heavy = sorted(m for m in ('sklearn', 'flwr_datasets', 'datasets', 'pandas') if m in sys.modules)\n"
        "print(json.dumps({'sum': float(s.train.x.sum()), 'n': len(s.train), 'heavy': heavy}))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), shard_cache.CACHE_ENV: str(cache)}

    def run() -> dict:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                             check=True, timeout=600)
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["heavy"] and warm["heavy"] == []  # the first process built it; the second read it
    assert (cold["sum"], cold["n"]) == (warm["sum"], warm["n"]) and warm["n"] > 0
