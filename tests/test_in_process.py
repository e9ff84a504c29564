"""fedapp.simulation's in-process runs: InProcessGrid (the ClientApp's handler without Ray),
simulate_in_process, and the ReplyCache experiments share between runs."""

import json

import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from fedapp.config import ConfigError, all_defaults
from fedapp.protocols import RUN_KEY
from fedapp.protocols.espresso import UPLOAD_KEY
from fedapp.protocols.moon import STATE_PREV_MODEL
from fedapp.protocols.records import tensors_of
from fedapp.server_app import run_server
from fedapp.simulation import InProcessGrid, ReplyCache, simulate_in_process
from warning_policy import GC_OF_EARLIER_LEAKS

# a warning in a run (fedapp's or a library's) fails the test: the default runs print none
pytestmark = [pytest.mark.usefixtures("inside_a_run", "one_torch_thread"), pytest.mark.filterwarnings("error"),
              pytest.mark.filterwarnings(GC_OF_EARLIER_LEAKS)]  # the later mark wins

ESPRESSO = {"method": "espresso", "dataset": "digit-styles", "partitioner.name": "domain", "partitioner.per-class": 2,
            "min-clients": 2, "espresso.embed-steps": 3, "espresso.steps": 3, "espresso.ratio": 1.0,
            "espresso.mixup-pairs": 8, "espresso.diffusions-per-latent": 2, "espresso.embed-batch": 8,
            "server-epochs": 1, "espresso.init": "gmm",
            "espresso.zigzag-t": 300}  # 3 DDIM steps are at t <= 666: Z-sampling acts on those above T_z


@pytest.fixture(scope="module")
def prior_dir(tmp_path_factory):
    from fedapp.models.prior.tiny import TEST_CONFIG, random_tiny_prior

    prior = random_tiny_prior(TEST_CONFIG, dataset="digit-styles", seed=0)
    return str(prior.save_pretrained(tmp_path_factory.mktemp("prior") / "tiny-random"))


def _uploads(cache: ReplyCache) -> dict[int, dict[str, torch.Tensor]]:
    from fedapp.protocols.records import partition_of

    out = {}
    for content in cache.replies():
        if UPLOAD_KEY in content.array_records:
            pid = partition_of(Message(content, dst_node_id=0, message_type="train"))
            out[pid] = tensors_of(content.array_records[UPLOAD_KEY])
    return out


def test_a_client_error_comes_back_as_an_error_reply():
    grid = InProcessGrid(2)
    flat = {**all_defaults(), "method": "fedavg"}
    msg = Message(RecordDict({RUN_KEY: ConfigRecord(flat)}), dst_node_id=grid.get_node_ids()[1],
                  message_type="query.nothing")
    (reply,) = grid.send_and_receive([msg])
    assert reply.has_error() and "no client handler for message type 'query.nothing'" in reply.error.reason
    assert reply.metadata.src_node_id == msg.metadata.dst_node_id


def test_simulate_in_process_checks_the_whole_config_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="espresso.sampler='euler'"):
        simulate_in_process({**ESPRESSO, "espresso.sampler": "euler", "out-dir": str(tmp_path)}, 2)
    with pytest.raises(ConfigError, match="domain"):  # digits has no domains: caught before the run
        simulate_in_process({**ESPRESSO, "dataset": "digits", "out-dir": str(tmp_path)}, 2)
    assert list(tmp_path.iterdir()) == []


def test_runs_differing_only_in_server_side_keys_reuse_the_clients_replies_exactly(tmp_path, prior_dir):
    base = {**ESPRESSO, "prior": prior_dir, "out-dir": str(tmp_path)}
    shared = ReplyCache()
    a = simulate_in_process({**base, "espresso.sampler": "ddim", "run-name": "a"}, 2, reply_cache=shared)
    assert (shared.hits, shared.misses) == (0, 4)  # train and evaluate, two clients
    b = simulate_in_process({**base, "espresso.sampler": "zigzag", "run-name": "b"}, 2, reply_cache=shared)
    # espresso.sampler is server-only: every train call is served from the cache; the evaluate calls
    # carry b's own classifier (other synthetic images) and run
    assert (shared.hits, shared.misses) == (2, 6)
    assert a["metrics"]["upload_bytes_per_client"] == b["metrics"]["upload_bytes_per_client"]

    # exact: b's config run afresh gives the clients' same uploads and the same result
    fresh = ReplyCache()
    b_fresh = simulate_in_process({**base, "espresso.sampler": "zigzag", "run-name": "b-fresh"}, 2, reply_cache=fresh)
    assert fresh.hits == 0
    ua, ub = _uploads(shared), _uploads(fresh)
    assert sorted(ua) == sorted(ub) == [0, 1]
    for pid in ua:
        assert ua[pid].keys() == ub[pid].keys() and all(torch.equal(ua[pid][k], ub[pid][k]) for k in ua[pid])
    assert b_fresh["metrics"]["accuracy"] == b["metrics"]["accuracy"]
    assert b_fresh["metrics"]["per_client_accuracy"] == b["metrics"]["per_client_accuracy"]

    # espresso.init changes what the clients compute (the GMM of z^T): no reuse
    hits = shared.hits
    simulate_in_process({**base, "espresso.init": "gaussian", "espresso.sampler": "zigzag", "run-name": "c"}, 2,
                        reply_cache=shared)
    assert shared.hits == hits


def test_a_stateful_client_gets_its_state_back_from_the_cache(tmp_path):
    # MOON keeps the previous local model in the node's state: a reused reply must leave it as the call did
    flat = {**all_defaults(), "method": "moon", "num-server-rounds": 2, "local-epochs": 1, "min-clients": 2,
            "partitioner.name": "iid", "partitioner.per-class": 3, "out-dir": str(tmp_path)}
    cache = ReplyCache()
    first, second = InProcessGrid(2, reply_cache=cache), InProcessGrid(2, reply_cache=cache)
    s1 = run_server(first, {**flat, "run-name": "moon"})
    misses = cache.misses
    # the same run again (moon's protocol has no server-only keys)
    s2 = run_server(second, {**flat, "run-name": "moon"})
    assert cache.misses == misses and cache.hits == misses  # every call of the second run reused
    assert s2["metrics"]["accuracy"] == s1["metrics"]["accuracy"]
    for n1, n2 in zip(first.nodes.values(), second.nodes.values()):
        p1 = n1.state.array_records[STATE_PREV_MODEL].to_torch_state_dict()
        p2 = n2.state.array_records[STATE_PREV_MODEL].to_torch_state_dict()
        assert p1.keys() == p2.keys() and all(torch.equal(p1[k], p2[k]) for k in p1)


def test_a_reply_cache_on_disk_serves_a_later_process_and_only_the_code_that_wrote_it(tmp_path, monkeypatch,
                                                                                     fedapp_log):
    """ReplyCache(folder): a fresh cache on the same folder (a later session's process) serves every call of
    the same run, states included; another code digest reads nothing; an unreadable entry is a miss."""
    import fedapp.simulation as sim

    flat = {**all_defaults(), "method": "moon", "num-server-rounds": 1, "local-epochs": 1, "min-clients": 2,
            "partitioner.name": "iid", "partitioner.per-class": 3, "out-dir": str(tmp_path), "run-name": "moon"}
    first = ReplyCache(tmp_path / "replies")
    grid1 = InProcessGrid(2, reply_cache=first)
    s1 = run_server(grid1, flat)
    calls = first.misses
    files = sorted(first.folder.glob("*.reply"))
    assert first.folder.parent == tmp_path / "replies" and len(files) == calls == 4  # 2 clients x (train, evaluate)
    later = ReplyCache(tmp_path / "replies")
    grid2 = InProcessGrid(2, reply_cache=later)
    s2 = run_server(grid2, flat)
    assert (later.hits, later.misses) == (calls, 0) and s2["metrics"] == s1["metrics"]
    for n1, n2 in zip(grid1.nodes.values(), grid2.nodes.values()):
        p1 = n1.state.array_records[STATE_PREV_MODEL].to_torch_state_dict()
        p2 = n2.state.array_records[STATE_PREV_MODEL].to_torch_state_dict()
        assert p1.keys() == p2.keys() and all(torch.equal(p1[k], p2[k]) for k in p1)
    # an unreadable entry: that call runs again, the rest are served
    files[0].write_bytes(files[0].read_bytes()[:-5])
    torn = ReplyCache(tmp_path / "replies")
    s3 = run_server(InProcessGrid(2, reply_cache=torn), flat)
    assert (torn.hits, torn.misses) == (calls - 1, 1) and s3["metrics"] == s1["metrics"]
    assert "unreadable (ValueError: truncated); the client runs again" in fedapp_log.text
    # other code: another subfolder, nothing read back
    monkeypatch.setattr(sim, "client_code_digest", lambda: "0" * 16)
    changed = ReplyCache(tmp_path / "replies")
    run_server(InProcessGrid(2, reply_cache=changed), flat)
    assert changed.hits == 0 and changed.folder != first.folder


@pytest.mark.parametrize("method, own", [("fedavg", None), ("fedprox", "fedprox.mu")])
def test_a_round_based_run_sends_its_clients_the_common_keys_and_its_own_namespace_only(tmp_path, method, own):
    from fedapp.protocols import FLOWER_CONFIG_KEYS
    from fedapp.report import REPORT
    from fedapp.simulation import resolve_run_config

    class Recording(InProcessGrid):
        def deliver(self, msg):
            sent.append((msg.metadata.message_type, dict(msg.content.config_records[RUN_KEY])))
            return super().deliver(msg)

    sent = []
    flat, run_dir = resolve_run_config({"method": method, "dataset": "digits", "partitioner.name": "iid",
                                        "partitioner.per-class": 3, "num-server-rounds": 1, "local-epochs": 1,
                                        "min-clients": 2, "out-dir": str(tmp_path)}, 2)
    assert any(k.startswith("dcfm.") for k in flat)  # the server is given every method's defaults
    assert run_server(Recording(2), flat)["status"] == "completed"
    assert {t for t, _ in sent} == {"train", "evaluate"}
    others = ("dcfm.", "pfdm.", "espresso.", "feddifrc.", "moon.") + (("fedprox.",) if own is None else ())
    config = json.loads((run_dir / "config.json").read_text())
    for _, rec in sent:
        assert not [k for k in rec if k.startswith(others)]
        assert {"lr", "partitioner.name", "log.tensorboard"} <= set(rec) and (own is None or own in rec)
        assert {k: v for k, v in rec.items() if k not in FLOWER_CONFIG_KEYS} == config
    table = (run_dir / REPORT).read_text().split("## Config")[1]
    assert "| lr |" in table and not any(f"| {ns}" in table for ns in others)


# The two families the tests above do not run in process (pfdm, feddifrc), at their smallest; with the
# module's filterwarnings("error"), a warning in a client fails the run and so the test.
QUIET = {
    "pfdm": {"method": "pfdm", "dataset": "colored-digits", "partitioner.name": "minority", "partitioner.per-class": 0,
             "image-size": 8, "num-server-rounds": 1, "pfdm.local-steps": 2, "pfdm.shared-steps": 2, "pfdm.samples": 20,
             "pfdm.sample-steps": 2, "pfdm.attack-samples": 10, "pfdm.ref-epochs": 1, "pfdm.batch": 16},
    "feddifrc": {"method": "feddifrc", "dataset": "digits", "feddifrc.up-blocks": "0,1", "partitioner.name": "iid",
                 "partitioner.per-class": 3, "num-server-rounds": 1, "local-epochs": 1},
}


@pytest.mark.parametrize("method", sorted(QUIET))
def test_a_small_run_prints_no_warning(tmp_path, prior_dir, method):
    prior = {"prior": prior_dir} if method == "feddifrc" else {}
    s = simulate_in_process({**QUIET[method], **prior, "min-clients": 2, "out-dir": str(tmp_path)}, 2)
    assert s["status"] == "completed" and s["failures"] == []
