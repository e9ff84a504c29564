"""Deployment: a real SuperLink, SuperNodes and `flwr run`, the way the README deploys the app.

The same app that runs as a Ray simulation runs unchanged on SuperNodes; each SuperNode learns its
shard only from `--node-config "partition-id=K num-partitions=N"`. Each test reads the run's
summary.json. What each one proves:

- TLS + SuperNode authentication across a LAN: the README's cross-host commands (`--host 0.0.0.0`);
  only the node whose public key was registered with `flwr supernode register` takes part, from its
  own network namespace over a veth pair (root only; else over the loopback); a stranger with a key
  and one without are refused;
- a SuperNode killed mid-run: the run completes and records that node's failure once, rightly;
- Espresso's built-in prior reaches each of 3 SuperNodes (each with its own prior cache, as separate
  machines have) once, and each keeps it.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from deploy_util import (HAVE_FLWR_CLI, NO_FLWR_CLI, Federation, VethNamespace, fast_heartbeat_missing,
                         fast_heartbeat_supernode, free_port, make_certs, make_node_key, netns_missing,
                         wait_for)

pytestmark = pytest.mark.skipif(not HAVE_FLWR_CLI, reason=NO_FLWR_CLI)

SUPERNODE_ID = r"SuperNode ID: (\d+)"  # what a SuperNode logs once the SuperLink accepted it


@pytest.fixture
def fed(tmp_path):
    f = Federation(tmp_path)
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture
def certs(tmp_path):
    """make_certs(*ips): a fresh CA and a SuperLink certificate for those addresses."""
    return lambda *ips: make_certs(tmp_path / "certs", ips)


def node_id(proc) -> int:
    return int(re.search(SUPERNODE_ID, wait_for(proc, SUPERNODE_ID, 60)).group(1))


def register(fed: Federation, public_key, connection: str) -> int:
    """`flwr supernode register`: the SuperLink's node id for that key."""
    res = fed.flwr("supernode", "register", str(public_key), connection, "--format", "json")
    found = re.search(r'"node-id":\s*(\d+)', res.stdout)
    assert res.returncode == 0 and found, res.stdout + res.stderr
    return int(found.group(1))


@pytest.mark.skipif(fast_heartbeat_missing() is not None, reason=str(fast_heartbeat_missing()))
def test_killed_supernode_is_recorded_once_and_the_run_completes(fed):
    """Three nodes, min-clients 2; the node serving partition 2 is SIGKILLed (its whole process
    group) the moment it receives round 1's train message, before its ClientApp starts, so it
    never replies. The SuperLink declares it unavailable after two missed heartbeats (that node
    promises one every 10 s, see fast_heartbeat_supernode); the round goes on with the other two
    and so does evaluation. The failure is recorded once, under the dead node's own id (the reply
    names the message it answers; Flower's error reply itself comes from the SuperLink), as
    unavailable, not as a timeout."""
    port = free_port()
    fed.superlink("127.0.0.1", port)
    fed.connection("loopback", f"127.0.0.1:{port}")
    nodes = [fed.supernode(f"node{k}", f"127.0.0.1:{port}", k, 3,
                           launcher=fast_heartbeat_supernode() if k == 2 else None) for k in range(3)]
    victim, victim_id = nodes[2], node_id(nodes[2])
    killed: list[BaseException | None] = []

    def kill_on_first_train_message():
        try:
            wait_for(victim, r"Receiving: train message", 180)
            victim.kill()
            killed.append(None)
        except BaseException as err:  # surfaced by the main thread
            killed.append(err)

    killer = threading.Thread(target=kill_on_first_train_message, daemon=True)
    killer.start()
    s = fed.run_app("loopback", "killed-node", min_clients=2)
    killer.join(timeout=30)
    assert killed == [None], killed

    assert s["status"] == "completed" and s["num_clients"] == 3
    assert set(s["metrics"]["per_client_accuracy"]) == {"0", "1"}  # evaluated without the dead node
    # the live nodes learned (3 thin shards, one round): chance 0.10, measured 0.26
    assert s["metrics"]["accuracy"] > 0.2
    failures = s["failures"]
    assert len(failures) == 1 and failures[0]["node_id"] == victim_id, failures
    failure = failures[0]
    assert "no reply within" not in failure["reason"]
    assert failure["phase"] == "train"
    assert failure["partition_id"] in (None, 2)  # it died before replying: its partition may be unknown
    assert "unavailable" in failure["reason"].lower()  # Flower's verdict, not a timeout


def test_each_supernode_downloads_the_prior_once_and_keeps_it(fed, tmp_path):
    """Three SuperNodes, each with a FEDAPP_CACHE of its own (as separate machines have), and the server's
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
    caches = [tmp_path / f"node{k}-cache" for k in range(3)]
    for k in range(3):
        fed.supernode(f"node{k}", f"127.0.0.1:{port}", k, 3, env={"FEDAPP_CACHE": str(caches[k])})
    s = fed.run_app("loopback", "espresso", min_clients=3, method="espresso", dataset="digit-styles",
                    prior="tiny", **{"partitioner.name": "domain", "partitioner.per-class": 2,
                                     "espresso.embed-steps": 2, "espresso.steps": 2, "espresso.ratio": 1.0,
                                     "espresso.mixup-pairs": 4, "espresso.embed-batch": 8, "server-epochs": 1,
                                     "espresso.ship-prior": "all"})
    assert s["status"] == "completed" and s["failures"] == [] and s["num_clients"] == 3
    by_node = json.loads((Path(s["run_dir"]) / "comm.json").read_text())["by_phase"].values()
    prior_down = sorted(phases["query.prior"]["down"] for phases in by_node)
    assert len(prior_down) == 3 and all(size < b < 1.1 * size for b in prior_down), (size, prior_down)
    assert [phases["query.prior"]["messages_down"] for phases in by_node] == [2, 2, 2]  # asked once, sent once
    assert all(phases["train"]["down"] < 50_000 for phases in by_node)  # the digest, not the weights
    assert [len(list((c / "priors").glob("shipped-*"))) for c in caches] == [1, 1, 1]


@pytest.fixture
def lan():
    """The member's network: a namespace joined by a veth pair (a second host on a LAN) where this process
    may make one (root), else the loopback. Yields (the SuperLink's address as the member sees it, the
    member's command prefix, the address the SuperLink sees the member come from)."""
    reason = netns_missing()
    ns = None
    if not reason:
        try:
            ns = VethNamespace.create()
        except RuntimeError as err:
            reason = str(err)
    if ns is None:
        print(f"lan: loopback ({reason})")
        yield "127.0.0.1", (), "127.0.0.1"
        return
    try:
        yield ns.host_ip, ns.exec, ns.ns_ip
    finally:
        ns.remove()


def test_tls_and_auth_admit_only_the_registered_node_across_a_lan(lan, fed, certs):
    """The README's cross-host commands: the SuperLink on all interfaces (`--host 0.0.0.0`) with TLS and
    `--enable-supernode-auth`. The one registered node runs inside a network namespace whose only way out
    is a veth pair (where the test may make one: root), so it reaches the SuperLink at its LAN address
    exactly as another machine would; two strangers on this machine (an unregistered key, no key) are
    refused. min-clients=1 and FedAvg sampling every connected node make the check exact: a stranger that
    got in would be trained and evaluated beside the member. (`lan` comes first: its teardown runs after
    `fed` has stopped the node inside it.)"""
    server, prefix, member_ip = lan
    tls = certs(*dict.fromkeys((server, "127.0.0.1")))  # 127.0.0.1: the SuperLink's own SuperExec connects there
    port = free_port("0.0.0.0")
    link = fed.superlink("0.0.0.0", port, tls, auth=True)
    fed.connection("lan", f"{server}:{port}", tls)
    member_key, member_pub = make_node_key(fed.folder / "keys", "member")
    stranger_key, _ = make_node_key(fed.folder / "keys", "stranger")
    registered_id = register(fed, member_pub, "lan")

    # The member is the whole federation (partition 0 of 1); each stranger claims to be a second
    # member (partition 1 of 2), so one that got in would show up as client "1".
    member = fed.supernode("member", f"{server}:{port}", 0, 1, tls, key=member_key, prefix=prefix)
    stranger = fed.supernode("stranger", f"127.0.0.1:{port}", 1, 2, tls, key=stranger_key)
    keyless = fed.supernode("keyless", f"127.0.0.1:{port}", 1, 2, tls)
    assert node_id(member) == registered_id
    # The SuperLink's access log: the member came in from its own network (the namespace's side of the pair).
    wait_for(link, rf'{re.escape(member_ip)}:\d+ - "POST /v1/fleet/activate-node HTTP/1.1" 200', 10)
    wait_for(stranger, r"Failed to activate SuperNode", 60)
    wait_for(keyless, r"SuperNode authentication is enabled\. All SuperNodes must be registered", 60)
    assert stranger.popen.wait(timeout=30) != 0 and keyless.popen.wait(timeout=30) != 0
    assert "No SuperNode found with the given public key" in link.text()  # the SuperLink's side

    s = fed.run_app("lan", "tls-auth", min_clients=1)
    assert s["status"] == "completed" and s["num_clients"] == 1
    assert set(s["metrics"]["per_client_accuracy"]) == {"0"}
    assert set(s["comm"]["per_client"]) == {"0"}
    assert s["metrics"]["accuracy"] > 0.6  # the member's round was used: one client alone gets 0.85
    assert s["failures"] == []
