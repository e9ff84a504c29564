"""Evaluation readers (fedapp.readers): trained once and cached, held-out accuracy, the unreliable flag,
and the sites that use them (DCFM's readers never see the test images)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import fedapp.readers as R

READER_SPLIT = R.reader_split  # the module's own, before the fixture stands in for it


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch, one_torch_thread):
    """Each test its own reader cache, a spy counting what train_classifier is given, and a fake server's
    reader split: its public images (the real one, public + pool of a feddata dataset, is tested below)."""
    monkeypatch.setenv(R.CACHE_ENV, str(tmp_path / "readers"))
    monkeypatch.setattr(R, "reader_split", lambda server: server.public)
    calls = []
    real = R.train_classifier

    def spy(model, x, y, **kw):
        calls.append((x, y, kw))
        return real(model, x, y, **kw)

    monkeypatch.setattr(R, "train_classifier", spy)
    return calls


def images(n: int, seed: int = 0, k: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 8, 8, generator=g) * 2 - 1, torch.arange(n) % k


def make(seed=0, attribute=R.LABEL, epochs=1, train=None, test=None) -> R.Reader:
    return R.reader("toy", 8, seed, attribute, epochs=epochs, num_classes=3, width=8,
                    train=train or images(24), test=test or images(12, seed=1))


def cached_files() -> list:
    return sorted(R.cache_dir().glob("*.pt"))


def test_a_cache_hit_is_the_same_model_without_training_again(own_cache, monkeypatch):
    first = make()
    assert len(own_cache) == 1 and len(cached_files()) == 1

    def no_training(*a, **kw):
        raise AssertionError("trained again")

    monkeypatch.setattr(R, "train_classifier", no_training)
    again = make()
    assert again.held_out_accuracy == first.held_out_accuracy and not again.model.training
    a, b = first.model.state_dict(), again.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_seed_epochs_attribute_and_data_are_each_their_own_entry(own_cache):
    make()
    make(seed=1)
    make(epochs=2)
    make(attribute="digit")
    make(train=images(24, seed=5))
    assert len(own_cache) == 5 and len(cached_files()) == 5
    make(epochs=2)  # and each is found again
    assert len(own_cache) == 5


def test_a_corrupted_cache_file_is_retrained_not_a_crash(own_cache, fedapp_log):
    first = make()
    (path,) = cached_files()
    path.write_bytes(b"not a state dict")
    again = make()
    assert len(own_cache) == 2 and "unreadable" in fedapp_log.text
    assert all(torch.equal(v, again.model.state_dict()[k]) for k, v in first.model.state_dict().items())
    make()  # the retrained file was written back whole
    assert len(own_cache) == 2


def test_an_unreliable_reader_is_flagged_and_warned_once(fedapp_log):
    # one test image under each of the 3 labels: exactly a third is read right, whatever the reader learnt
    x = images(1)[0].repeat(6, 1, 1, 1)
    weak = make(test=(x, torch.arange(6) % 3))
    assert weak.held_out_accuracy == pytest.approx(1 / 3) and weak.threshold == 0.97 and not weak.reliable
    fedapp_log.clear()
    out = R.reader_metrics([weak, R.Reader("color", weak.model, 0.995, R.THRESHOLDS["color"])])
    assert out == {"reader_accuracy": {"label": weak.held_out_accuracy, "color": 0.995}, "reader_unreliable": True,
                   "unreliable_readers": ["label"]}
    (line,) = [r for r in fedapp_log.records if r.levelno == logging.WARNING]
    assert line.name == "fedapp" and "label reader 0.3333 < 0.97" in line.getMessage()


def test_readers_at_their_threshold_are_reliable_and_quiet(fedapp_log):
    net = torch.nn.Linear(1, 1)
    readers = [R.Reader(a, net, R.THRESHOLDS.get(a, R.DEFAULT_THRESHOLD), R.THRESHOLDS.get(a, R.DEFAULT_THRESHOLD))
               for a in ("label", "digit", "color", "domain")]
    assert [r.threshold for r in readers] == [0.97, 0.97, 0.99, 0.95]
    out = R.reader_metrics(readers)
    assert out["reader_unreliable"] is False and out["unreliable_readers"] == []
    assert not [r for r in fedapp_log.records if r.levelno >= logging.WARNING]


def fake_server(n_public=30, n_test=12) -> SimpleNamespace:
    """A feddata ServerData look-alike with digit, colour and domain attributes."""
    def split(n, seed):
        x, y = images(n, seed)
        return SimpleNamespace(x=x, y=y, attrs={"digit": y, "color": (torch.arange(n) // 3) % 2,
                                                "domain": torch.arange(n) % 4})

    info = SimpleNamespace(name="toy", num_classes=3, channels=3,
                           attributes={"digit": ["0", "1", "2"], "color": ["red", "green"], "domain": list("abcd")})
    return SimpleNamespace(info=info, public=split(n_public, 0), test=split(n_test, 1))


def test_a_reader_trains_on_everything_but_the_test_split():
    """public + client pool of a built-in dataset, disjoint from the test split by source image."""
    import feddata
    from feddata.sources import base_split

    server = feddata.load_server_data("digits", "iid", {}, 0, num_partitions=4)
    train = READER_SPLIT(server)
    parts = base_split("digits", 16)
    assert sorted(train.index.tolist()) == sorted(parts["public"].tolist() + parts["pool"].tolist())
    assert not set(train.source.tolist()) & set(server.test.source.tolist())
    assert train.x.shape[1:] == server.test.x.shape[1:]


def test_dcfm_readers_train_without_test_images(own_cache):
    from strategies.flow import FlowEvaluation

    server = fake_server()
    task = SimpleNamespace(server=server, opts=SimpleNamespace(ref_epochs=1))
    readers = FlowEvaluation(SimpleNamespace(cfg=SimpleNamespace(seed=0)), task).reference_classifiers()
    assert list(readers) == ["digit", "color"] and [r.threshold for r in readers.values()] == [0.97, 0.99]
    assert len(own_cache) == 2
    for x, _, _ in own_cache:  # every image it trained on is a public one; no test image among them
        assert torch.equal(x, server.public.x)
    for a, r in readers.items():
        truth = server.test.attrs[a]
        assert r.held_out_accuracy == pytest.approx(float((r.model(server.test.x).argmax(1) == truth).float().mean()))


def test_espresso_fidelity_readers_report_accuracy_and_the_flag(own_cache):
    from experiments.espresso_ablation import fidelity_readers

    out = fidelity_readers(fake_server(), seed=0, epochs=1)
    assert isinstance(out["class"], torch.nn.Module) and isinstance(out["domain"], torch.nn.Module)
    assert out["reader_accuracy"] == {"label": out["class_reader_test_accuracy"],
                                      "domain": out["domain_reader_test_accuracy"]}
    assert isinstance(out["reader_unreliable"], bool)
    assert all(len(x) == 30 for x, _, _ in own_cache)


def test_the_cache_lives_beside_the_priors_unless_pointed_elsewhere(tmp_path, monkeypatch):
    from fedapp.models.prior.tiny import cache_root

    monkeypatch.delenv(R.CACHE_ENV)
    monkeypatch.setenv("FEDAPP_CACHE", str(tmp_path))
    assert R.cache_dir() == tmp_path / "readers" and cache_root() == tmp_path / "priors"


def test_a_cache_entry_is_named_by_its_facts_not_their_order():
    """The one digest the reader, prior and train-state caches name their entries by: the order of the facts
    does not change it, any fact's value does, and its length is the caller's."""
    from fedapp.models.cache import facts_digest

    a = facts_digest({"dataset": "digits", "seed": 0, "epochs": [1, 2]})
    assert a == facts_digest({"epochs": [1, 2], "seed": 0, "dataset": "digits"}) and len(a) == 12
    assert a != facts_digest({"dataset": "digits", "seed": 1, "epochs": [1, 2]})
    assert len(facts_digest({"x": 1}, 16)) == 16 and facts_digest({"x": 1}, 16).startswith(facts_digest({"x": 1}))
