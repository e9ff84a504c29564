"""Deployment: a real SuperLink, SuperNodes and `flwr run`, the way the README deploys the app.

The same app that runs as a Ray simulation runs unchanged on SuperNodes; each SuperNode learns its
shard only from `--node-config "partition-id=K num-partitions=N"`. Each test reads the run's
summary.json. What each one proves:

- TLS + SuperNode authentication across a LAN: the README's cross-host commands (`--host 0.0.0.0`);
  only the node whose public key was registered with `flwr supernode register` takes part, from its
  own network namespace over a veth pair (root only; else over the loopback); a stranger with a key
  and one without are refused;
- a SuperNode killed mid-run: the run completes and records that node's failure once, rightly.

Espresso's prior shipped to SuperNodes: tests/test_deployment_prior.py (its own module, so that pytest-xdist
can run it beside these).
"""

from __future__ import annotations

import re
import threading

import pytest

from deploy_util import (HAVE_FLWR_CLI, NO_FLWR_CLI, Federation, VethNamespace, fast_heartbeat_missing,
                         fast_heartbeat_supernode, free_port, make_certs, make_node_key, netns_missing,
                         wait_for)

pytestmark = pytest.mark.skipif(not HAVE_FLWR_CLI, reason=NO_FLWR_CLI)

SUPERNODE_ID = r"SuperNode ID: (\d+)"  # what a SuperNode logs once the SuperLink accepted it


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
