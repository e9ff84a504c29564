"""Progress lines of long client phases (fedapp.progress): rate, counts and the client's label."""

import os
import re
import sys

import pytest

from fedapp import progress
from fedapp.progress import client_scope, track


def _counts(caplog, what):
    """(done, total, seconds) of every progress line about `what`."""
    lines = [re.fullmatch(rf"(?:client \d+: )?{what} (\d+)/(\d+), (\d+) s", r.getMessage()) for r in caplog.records]
    return [tuple(int(g) for g in m.groups()) for m in lines if m]


def test_a_fast_phase_logs_no_progress_line(fedapp_log, monkeypatch):
    """Four clients' `noise GMMs k/10, 0 s` x 10 each said nothing: a phase done within QUIET_SECONDS is silent,
    its last line included."""
    clock = iter([100.0, *(100.0 + 0.4 * i for i in range(1, 11))])  # 10 units of 0.4 s: 4 s in all
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    with client_scope(1):
        assert list(track(range(10), "noise GMMs")) == list(range(10))
    assert progress.QUIET_SECONDS > 4 and fedapp_log.records == []
    monkeypatch.undo()
    list(track(range(3), "steps"))  # real time, a few microseconds
    assert fedapp_log.records == []


def test_a_phase_past_the_quiet_seconds_logs_from_then_on_and_its_end(fedapp_log, monkeypatch):
    clock = iter([0.0, *(1.0 * i for i in range(1, 21))])  # 20 units of 1 s
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    list(track(range(20), "condition steps"))
    counts = _counts(fedapp_log, "condition steps")
    assert counts[0][2] >= progress.QUIET_SECONDS  # nothing before the quiet seconds
    assert counts == [(d, 20, d) for d in (5, 7, 9, 11, 13, 15, 17, 19, 20)]  # then every tenth, and the end


def test_the_count_rule_logs_every_tenth_and_the_last_labelled_with_its_client(fedapp_log, monkeypatch):
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)
    monkeypatch.setattr(progress.time, "monotonic", lambda: 100.0)  # no time passes: only the 10% rule
    with client_scope(2):
        assert list(track(range(25), "condition steps")) == list(range(25))
    assert [(d, n) for d, n, _ in _counts(fedapp_log, "condition steps")] == [
        (i, 25) for i in (2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 25)]
    assert all(r.getMessage().startswith("client 2: ") for r in fedapp_log.records)
    fedapp_log.clear()
    list(track(["a", "b"], "noise GMMs"))  # outside a client scope: no label
    assert [r.getMessage() for r in fedapp_log.records] == ["noise GMMs 1/2, 0 s", "noise GMMs 2/2, 0 s"]


def test_a_slow_phase_logs_at_least_every_ten_seconds(fedapp_log, monkeypatch):
    clock = iter(range(0, 10_000, 4))  # each item takes 4 s
    monkeypatch.setattr(progress.time, "monotonic", lambda: float(next(clock)))
    list(track(range(100), "target prompts"))
    counts = _counts(fedapp_log, "target prompts")
    assert counts[:3] == [(3, 100, 12), (6, 100, 24), (9, 100, 36)]  # 12 s apart, long before 10% is done
    assert counts[-1] == (100, 100, 400)


@pytest.mark.parametrize("n", [0, 1])
def test_tiny_phases_log_their_end_without_the_quiet_seconds(fedapp_log, monkeypatch, n):
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)
    list(track(range(n), "steps"))
    assert [(d, t) for d, t, _ in _counts(fedapp_log, "steps")] == [(n, n)] * n


# ---- the clients' lines under Ray: as they come, before the reply --------------------------------------------
def _ray_batch(pid: int, line: str) -> dict:
    return {"ip": "127.0.0.1", "pid": pid, "is_err": True, "job": "01", "lines": [line]}


def test_the_driver_prints_each_clients_line_not_a_later_repeated_count(monkeypatch):
    """Ray merges lines that differ only in numbers across workers and prints `[repeated Nx across cluster]`
    later, the rest when Ray shuts down, after the run's end. The ServerApp (Ray's driver under `flwr run`)
    turns that off: each client's line is printed when it arrives."""
    from ray._private import ray_constants, ray_logging

    from fedapp.progress import no_ray_log_dedup

    monkeypatch.delenv("RAY_DEDUP_LOGS", raising=False)
    monkeypatch.setattr(ray_logging, "RAY_DEDUP_LOGS", True)  # Ray's default (and restored after the test)
    monkeypatch.setattr(ray_constants, "RAY_DEDUP_LOGS", True)
    dedup = ray_logging.LogDeduplicator(5, None, None, _timesource=lambda: 0.0)
    assert dedup.deduplicate(_ray_batch(1, "client 1: condition steps 40/100, 12 s"))[0]["lines"] != []
    assert dedup.deduplicate(_ray_batch(2, "client 2: condition steps 40/100, 12 s"))[0]["lines"] == []  # held
    assert no_ray_log_dedup() and os.environ["RAY_DEDUP_LOGS"] == "0" and ray_logging.RAY_DEDUP_LOGS is False
    out = dedup.deduplicate(_ray_batch(3, "client 3: condition steps 40/100, 12 s"))
    assert [line for b in out for line in b["lines"]] == ["client 3: condition steps 40/100, 12 s"]


@pytest.mark.parametrize("value", ["1", "true"])
def test_a_ray_dedup_the_user_asked_for_is_kept(monkeypatch, value):
    from ray._private import ray_logging

    from fedapp.progress import no_ray_log_dedup

    monkeypatch.setenv("RAY_DEDUP_LOGS", value)
    monkeypatch.setattr(ray_logging, "RAY_DEDUP_LOGS", True)
    assert not no_ray_log_dedup() and ray_logging.RAY_DEDUP_LOGS is True and os.environ["RAY_DEDUP_LOGS"] == value


@pytest.mark.usefixtures("inside_a_run")
@pytest.mark.parametrize("fails", [False, True])
def test_a_client_flushes_its_lines_before_its_reply_leaves(monkeypatch, fails):
    """A line still in a buffer when the reply leaves reached Flower's log after the run's end."""
    import clients.espresso
    from flwr.app import ConfigRecord, Message, RecordDict

    from fedapp.config import all_defaults
    from fedapp.protocols import RUN_KEY
    from fedapp.simulation import InProcessGrid

    events = []

    class Buffered:  # a stdout that keeps what it is given until flushed
        def write(self, text):
            events.append(("write", text))
            return len(text)

        def flush(self):
            events.append(("flush",))

    def handler(msg, ctx):
        print("client work", end="")
        if fails:
            raise ValueError("the handler failed")
        return RecordDict()

    monkeypatch.setitem(clients.espresso.HANDLERS, "query.prior", handler)
    grid = InProcessGrid(1)
    msg = Message(RecordDict({RUN_KEY: ConfigRecord({**all_defaults(), "method": "espresso"})}),
                  dst_node_id=grid.get_node_ids()[0], message_type="query.prior")
    monkeypatch.setattr(sys, "stdout", Buffered())
    (reply,) = grid.send_and_receive([msg])
    monkeypatch.undo()
    assert reply.has_error() == fails
    assert events.index(("write", "client work")) < len(events) - 1 and events[-1] == ("flush",)


# ---- the server's lines: ETA, rounds, phases ------------------------------------------------------------
def test_duration_reads_as_seconds_minutes_or_hours():
    assert [progress.duration(s) for s in (0.4, 89, 150, 5399, 5400)] == ["0 s", "89 s", "2 min", "90 min", "1.5 h"]


def test_a_server_phase_logs_its_eta_from_the_mean_rate(fedapp_log, monkeypatch):
    clock = iter([0.0, 10.0, 20.0])  # created at 0; 1000 images by 10 s, 1500 more by 20 s
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    p = progress.Progress("synthesis", 5000, unit="images", eta=True)
    p.advance(1000)
    p.advance(1500)
    assert [r.getMessage() for r in fedapp_log.records] == [
        "synthesis 1000/5000 images, 10 s, ETA 40 s", "synthesis 2500/5000 images, 20 s, ETA 20 s"]


def test_round_lines_count_rounds_and_estimate_the_rest(fedapp_log, monkeypatch):
    clock = iter([0.0, 12.0, 12.0, 30.0])  # round 1 takes 12 s, round 2 18 s
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    rounds = progress.Rounds(total=12)
    for rnd in (1, 2):
        rounds.start(rnd, "train on 5 of 100 clients")
        rounds.end(rnd)
    assert [r.getMessage() for r in fedapp_log.records] == [
        "round 1/12: train on 5 of 100 clients", "round 1/12 done in 12.0 s, ETA 2 min",  # 11 x 12 s
        "round 2/12: train on 5 of 100 clients", "round 2/12 done in 18.0 s, ETA 2 min"]  # 10 x 15 s


@pytest.mark.usefixtures("inside_a_run", "one_torch_thread")
def test_a_fedavg_simulation_logs_each_round_with_its_sample_and_eta(fedapp_log, tmp_path):
    from fedapp.simulation import simulate_in_process

    simulate_in_process({"method": "fedavg", "dataset": "digits", "partitioner.name": "iid", "partitioner.per-class": 3,
                         "num-server-rounds": 3, "local-epochs": 1, "min-clients": 2, "fraction-train": 0.5,
                         "out-dir": str(tmp_path)}, 4)
    lines = [r.getMessage() for r in fedapp_log.records if r.getMessage().startswith("round ")]
    assert [re.sub(r"[\d.]+ s|\d+ min", "T", line) for line in lines] == [
        "round 1/3: train on 2 of 4 clients", "round 1/3 done in T, ETA T",
        "round 2/3: train on 2 of 4 clients", "round 2/3 done in T, ETA T",
        "round 3/3: train on 2 of 4 clients", "round 3/3 done in T"]


@pytest.mark.usefixtures("inside_a_run", "one_torch_thread")
def test_espresso_logs_its_phases_synthesis_and_server_epochs(fedapp_log, tmp_path, monkeypatch):
    from fedapp.models.prior.tiny import TEST_CONFIG, random_tiny_prior
    from fedapp.simulation import simulate_in_process

    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)  # a test-sized run's phases are all short

    prior = random_tiny_prior(TEST_CONFIG, dataset="digit-styles", seed=0).save_pretrained(tmp_path / "prior")
    s = simulate_in_process({"method": "espresso", "dataset": "digit-styles", "partitioner.name": "domain",
                             "partitioner.per-class": 2, "min-clients": 2, "prior": str(prior),
                             "espresso.embed-steps": 2, "espresso.steps": 2, "espresso.ratio": 1.0,
                             "espresso.mixup-pairs": 4, "espresso.diffusions-per-latent": 1, "espresso.embed-batch": 8,
                             "espresso.synth-batch": 8, "server-epochs": 3, "out-dir": str(tmp_path)}, 2)
    n = s["metrics"]["num_synthetic"]
    assert n == 2 * 2 * 10  # ratio 1 x 2 images per class x 10 classes x 2 clients
    lines = [r.getMessage() for r in fedapp_log.records if not r.getMessage().startswith("client ")]
    assert f"synthesis: {n} images for 2 clients" in lines and "classifier: 3 epochs on 40 synthetic images" in lines
    assert "[train] to 2 clients" in lines and "[evaluate] to 2 clients" in lines
    synth = [tuple(map(int, m.groups())) for m in (re.fullmatch(r"synthesis (\d+)/(\d+) images, \d+ s(?:, ETA .+)?", x)
                                                  for x in lines) if m]
    assert (synth[-1] == (n, n) and all(t == n for _, t in synth)
            and [d for d, _ in synth] == sorted(d for d, _ in synth))
    epochs = [x for x in lines if x.startswith("server training epoch ")]
    assert [re.sub(r", \d+ s.*", "", x) for x in epochs] == [f"server training epoch {i}/3" for i in (1, 2, 3)]
    assert all("ETA" in x for x in epochs[:2]) and "ETA" not in epochs[-1]
    for phase in ("prior", "synthesis", "classifier"):
        assert any(re.fullmatch(rf"{phase} done in [\d.]+ s", x) for x in lines), phase


def test_one_shot_client_accuracies_stay_one_short_line_at_many_clients(fedapp_log):
    from strategies.oneshot import log_client_accuracies

    log_client_accuracies({k: {"accuracy": k / 100} for k in (2, 1)})
    log_client_accuracies({k: {"accuracy": k / 1000} for k in range(1000)})
    assert [r.getMessage() for r in fedapp_log.records] == [
        "per-client test accuracy: {1: 0.01, 2: 0.02}",
        "per-client test accuracy over 1000 clients: min 0.0000, median 0.5000, max 0.9990"]
