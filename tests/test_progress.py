"""Progress lines of long client phases (fedapp.progress): rate, counts and the client's label."""

import re

import pytest

from fedapp import progress
from fedapp.progress import client_scope, track


def _counts(caplog, what):
    """(done, total, seconds) of every progress line about `what`."""
    lines = [re.fullmatch(rf"(?:client \d+: )?{what} (\d+)/(\d+), (\d+) s", r.getMessage()) for r in caplog.records]
    return [tuple(int(g) for g in m.groups()) for m in lines if m]


def test_a_fast_phase_logs_every_tenth_and_the_last_labelled_with_its_client(fedapp_log, monkeypatch):
    monkeypatch.setattr(progress.time, "monotonic", lambda: 100.0)  # no time passes: only the 10% rule
    with client_scope(2):
        assert list(track(range(25), "condition steps")) == list(range(25))
    assert [(d, n) for d, n, _ in _counts(fedapp_log, "condition steps")] == [(i, 25) for i in (2, 4, 6, 8, 10, 12,
                                                                                               14, 16, 18, 20, 22, 24, 25)]
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
def test_tiny_phases_log_their_end(fedapp_log, n):
    list(track(range(n), "steps"))
    assert [(d, t) for d, t, _ in _counts(fedapp_log, "steps")] == [(n, n)] * n
