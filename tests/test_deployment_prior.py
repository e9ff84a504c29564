"""Deployment: Espresso's built-in prior reaches each SuperNode once, and each keeps it.

A real SuperLink, two SuperNodes (each with a prior cache of its own, as separate machines have) and
`flwr run`, as in tests/test_deployment.py; a module of its own so that pytest-xdist runs it beside those.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy_util import HAVE_FLWR_CLI, NO_FLWR_CLI, free_port

pytestmark = pytest.mark.skipif(not HAVE_FLWR_CLI, reason=NO_FLWR_CLI)


def test_each_supernode_downloads_the_prior_once_and_keeps_it(fed, tmp_path):
    """Two SuperNodes, each with a FEDAPP_CACHE of its own (as separate machines have), and the server's
    built-in prior (here a random one where `tiny` resolves in the server's cache). The server announces it
    by its digest (query.prior) and sends the weights to the nodes that lack it (`espresso.ship-prior=all`:
    at once, one SuperNode per machine): every node gets them once (query.prior's bytes down, from the
    run's comm.json, are the prior's size per node) and keeps them in its cache under that digest; train
    messages carry the digest only."""
    import shutil

    from fedapp.models.prior.tiny import TEST_CONFIG, random_tiny_prior, tiny_prior_path

    fed.env["FEDAPP_CACHE"] = str(tmp_path / "server-cache")  # the SuperLink's, so the ServerApp's
    prior = random_tiny_prior(TEST_CONFIG, dataset="digit-styles", seed=0).save_pretrained(tmp_path / "prior")
    shutil.copytree(prior, tiny_prior_path("digit-styles", cache_dir=tmp_path / "server-cache" / "priors"))
    size = sum(f.stat().st_size for f in Path(prior).rglob("*") if f.is_file())
    port = free_port()
    fed.superlink("127.0.0.1", port)
    fed.connection("loopback", f"127.0.0.1:{port}")
    caches = [tmp_path / f"node{k}-cache" for k in range(2)]
    for k in range(2):
        fed.supernode(f"node{k}", f"127.0.0.1:{port}", k, 2, env={"FEDAPP_CACHE": str(caches[k])})
    s = fed.run_app("loopback", "espresso", min_clients=2, method="espresso", dataset="digit-styles",
                    prior="tiny", **{"partitioner.name": "domain", "partitioner.per-class": 2,
                                     "espresso.embed-steps": 2, "espresso.steps": 2, "espresso.ratio": 1.0,
                                     "espresso.mixup-pairs": 4, "espresso.embed-batch": 8, "server-epochs": 1,
                                     "espresso.ship-prior": "all"})
    assert s["status"] == "completed" and s["failures"] == [] and s["num_clients"] == 2
    by_node = json.loads((Path(s["run_dir"]) / "comm.json").read_text())["by_phase"].values()
    prior_down = sorted(phases["query.prior"]["down"] for phases in by_node)
    assert len(prior_down) == 2 and all(size < b < 1.1 * size for b in prior_down), (size, prior_down)
    assert [phases["query.prior"]["messages_down"] for phases in by_node] == [2, 2]  # asked once, sent once
    assert all(phases["train"]["down"] < 50_000 for phases in by_node)  # the digest, not the weights
    assert [len(list((c / "priors").glob("shipped-*"))) for c in caches] == [1, 1]
