"""The privacy audit (fedapp/audit/, experiments/privacy_audit.py, experiments/audit_targets.py): a planted leak
scores AUC ~ 1 and no leak ~ 0.5 inside its bootstrap interval; TPR at 1 % FPR as read by hand off a ROC curve;
the near-copy share of a planted copy; the overfitted control beats the no-member control; a run keeps what each
client uploaded; the leaderboard's privacy front."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedapp.audit.membership import bootstrap_figures, mia_figures, tpr_at_fpr
from fedapp.audit.reconstruction import near_copy_figures
from fedapp.audit.scores import lira_offline, nearest_scores


def _features(n: int, seed: int, dim: int = 16) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


def test_a_planted_leak_scores_auc_one_and_no_leak_chance_inside_its_interval():
    members, nonmembers = _features(80, 0), _features(80, 1)
    # the attacker's generated set holds a copy of every member: each member is at distance 0 from it
    leak = torch.cat([members, _features(80, 2)])
    f = bootstrap_figures(nearest_scores(members, leak), nearest_scores(nonmembers, leak), seed=0, resamples=300)
    assert f["mia_auc"]["value"] == 1.0 and f["mia_auc"]["low"] > 0.99
    assert f["mia_tpr_at_1fpr"]["value"] == 1.0
    # generated from the same distribution, independent of both: members are no nearer than non-members
    fresh = _features(160, 3)
    f = bootstrap_figures(nearest_scores(members, fresh), nearest_scores(nonmembers, fresh), seed=0, resamples=300)
    assert f["mia_auc"]["low"] < 0.5 < f["mia_auc"]["high"]
    assert f["mia_auc"]["high"] - f["mia_auc"]["low"] < 0.25  # 80 + 80 candidates: an interval that says something
    assert (f["members"], f["nonmembers"], f["fpr_step"]) == (80, 80, 1 / 80)


def test_tpr_at_1_percent_fpr_is_read_off_the_roc_curve_without_interpolation():
    members = np.array([10.0, 9.0, 8.0, 0.5, -5.0])
    # 100 non-members, one of them above three members: one false positive is 1 % FPR
    nonmembers = np.concatenate([[9.5], -np.linspace(0.1, 1.0, 99)])
    lab = np.r_[np.ones(5), np.zeros(100)]
    assert tpr_at_fpr(lab, np.r_[members, nonmembers]) == pytest.approx(0.8)  # 10, 9, 8, 0.5 above the cut
    # 50 non-members: the smallest FPR above 0 is 2 %, so only the threshold above every non-member counts
    nonmembers = np.concatenate([[9.5], -np.linspace(0.1, 1.0, 49)])
    f = mia_figures(members, nonmembers)
    assert f["mia_tpr_at_1fpr"] == pytest.approx(0.2)  # only 10 beats 9.5; interpolating would say 0.5
    from sklearn.metrics import roc_auc_score

    assert f["mia_auc"] == pytest.approx(roc_auc_score(np.r_[np.ones(5), np.zeros(50)], np.r_[members, nonmembers]))
    with pytest.raises(ValueError, match="must be finite"):
        mia_figures(np.array([np.nan]), np.array([0.0]))


def test_near_copy_share_counts_planted_copies_against_a_threshold_set_on_non_members():
    members, nonmembers = _features(100, 0), _features(100, 1)
    generated = torch.cat([members[:10] + 1e-6, _features(90, 2)])  # 10 % copies of members
    f = near_copy_figures(generated, members, nonmembers)
    assert f["quantile"] == 0.01 and f["generated"] == 100
    assert f["threshold"] == pytest.approx(np.quantile(f["nonmember_distances"], 0.01))
    assert np.all(np.array(f["member_distances"][:10]) < 1e-5)
    assert 0.10 <= f["near_copy_share"] <= 0.14  # the copies, and about 1 % of the 90 fresh draws
    assert f["nonmember_share"] <= 0.02
    clean = near_copy_figures(_features(100, 2), members, nonmembers)
    assert clean["near_copy_share"] <= 0.04
    with pytest.raises(ValueError, match="must be equally many"):
        near_copy_figures(generated, members, nonmembers[:50])


def test_likelihood_ratio_ranks_by_how_far_above_its_shadows_a_candidate_sits():
    shadows = np.array([[0.0, 5.0, 1.0], [0.2, 5.2, 1.2], [-0.2, 4.8, 0.8]])
    # candidate 1 has the highest raw confidence, but it is what every shadow gives it: not a member
    s = lira_offline(np.array([3.0, 5.0, 1.0]), shadows)
    assert s.argmax() == 0 and s[1] == pytest.approx(0.0) and s[2] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="S >= 2 shadow models"):
        lira_offline(np.zeros(3), shadows[:1])


def _control_view(tmp_path):
    """The controls' FedAvg config on the audit's tiny setting (one style a client, 4 images a class), unrun."""
    from experiments.audit_targets import RunView
    from fedapp.config import parse_run_config

    flat = {"method": "fedavg", "dataset": "digit-styles", "partitioner.name": "domain", "partitioner.per-class": 4,
            "image-size": 16, "min-clients": 4, "device": "cpu", "seed": 0}
    return RunView(tmp_path, flat, parse_run_config(flat), 4)


def test_the_overfitted_control_leaks_and_the_no_member_control_does_not(tmp_path, one_torch_thread):
    """The audit's control on a FedAvg config of its tiny setting (one style a client, 4 images a class)."""
    from experiments.privacy_audit import CONTROL_OVERFIT, CONTROL_SAME, controls

    view = _control_view(tmp_path)
    got = controls(view, {"cap": 60, "shadows": 2, "overfit_epochs": 30, "resamples": 300}, seed=0)
    leak = got[CONTROL_OVERFIT]["attacks"]
    none = got[CONTROL_SAME]["attacks"]["upload/loss"]["mia_auc"]
    assert leak["upload/loss"]["members"] == 40 and got[CONTROL_SAME]["attacks"]["upload/loss"]["members"] == 80
    assert leak["upload/loss"]["mia_auc"]["low"] > 0.9  # built to leak: the loss attack sees it
    assert leak["upload/lira"]["mia_auc"]["low"] > 0.8  # and so does the likelihood ratio against its shadows
    assert none["low"] < 0.5 < none["high"]  # no member at all: chance, inside its interval
    assert leak["upload/loss"]["mia_auc"]["low"] > none["high"]


def test_the_overfitted_control_trains_on_the_attacked_members_alone(tmp_path, one_torch_thread, monkeypatch):
    """With the member sample capped below the client's training split, the control's model sees exactly the
    members (a digit classifier trained on more of the client's images generalises to its held-out ones and
    gives the attacks nothing to read), and the control reports the accuracy gap the attacks read."""
    from experiments import audit_targets as T
    from experiments.privacy_audit import CONTROL_OVERFIT, controls

    view = _control_view(tmp_path)
    seen, real = [], T.overfit_model
    monkeypatch.setattr(T, "overfit_model", lambda v, train, *a: seen.append(train) or real(v, train, *a))
    got = controls(view, {"cap": 10, "shadows": 2, "overfit_epochs": 5, "resamples": 50}, seed=0)
    members, _ = T.candidates(view, 10, 0)[0]
    assert len(T.all_shards(view)[0].train) == 40 and len(seen) == 1
    assert torch.equal(seen[0].x, members.x) and torch.equal(seen[0].y, members.y)
    figs = got[CONTROL_OVERFIT]
    assert figs["attacks"]["upload/loss"]["members"] == 10 and figs["client"] == 0  # equally many: the first
    assert 0.0 <= figs["nonmember_accuracy"] <= 1.0 and 0.0 <= figs["member_accuracy"] <= 1.0
    assert figs["member_accuracy"] > figs["nonmember_accuracy"]  # 10 images, 5 epochs: the gap is there


def test_a_shadow_set_is_public_images_of_the_clients_class_counts_and_domain():
    from experiments.audit_targets import shadow_set
    from feddata.types import Split

    n = 60
    public = Split(torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1), torch.arange(n) % 3,
                   attrs={"domain": (torch.arange(n) // 3) % 2})  # 10 of each (class, domain)
    like = Split(torch.zeros(7, 1, 1, 1), torch.tensor([0, 0, 0, 1, 1, 2, 2]), attrs={"domain": torch.ones(7).long()})
    got = shadow_set(public, like, torch.Generator().manual_seed(0))
    assert torch.bincount(got.y, minlength=3).tolist() == [3, 2, 2]
    assert set(got.attrs["domain"].tolist()) == {1} and len(set(got.x.flatten().tolist())) == 7  # distinct images
    again = shadow_set(public, like, torch.Generator().manual_seed(1))
    assert not torch.equal(got.x, again.x)  # each shadow its own draw


@pytest.mark.usefixtures("inside_a_run", "one_torch_thread")
def test_a_run_keeps_each_clients_last_upload_and_the_model_it_started_from(tmp_path):
    from safetensors.torch import load_file

    from fedapp.protocols import ARRAYS_KEY
    from fedapp.server.uploads import kept_phases, load_uploads
    from fedapp.simulation import simulate_in_process

    flat = {"method": "fedavg", "dataset": "digits", "partitioner.name": "iid", "num-server-rounds": 2,
            "local-epochs": 1, "min-clients": 2, "out-dir": str(tmp_path), "run-name": "r", "log.uploads": True}
    summary = simulate_in_process(flat, 2)
    assert summary["status"] == "completed"
    run_dir = tmp_path / "r"
    assert kept_phases(run_dir) == ["train"]  # evaluate replies carry no arrays
    kept = load_uploads(run_dir, "train")
    assert sorted(kept) == [0, 1] and all(k.replies == 2 for k in kept.values())
    final = load_file(str(run_dir / "model.safetensors"))
    # FedAvg's last round: the global model is the num-examples weighted mean of exactly these uploads
    from fedapp.config import parse_run_config
    from fedapp.data import client_shard

    from fedapp.models.classifier import build_classifier
    from fedapp.protocols.weights import flat_of, unpack

    n = [len(client_shard(parse_run_config(flat), p, 2).train) for p in (0, 1)]
    like = build_classifier("cnn", 10).state_dict()  # the packed records' layout (fedapp.protocols.weights)
    up, down = ([unpack(flat_of(k.up[ARRAYS_KEY] if side == "up" else k.down[ARRAYS_KEY]), like)
                 for k in (kept[0], kept[1])] for side in ("up", "down"))
    assert set(final) == set(like)
    for name, value in final.items():
        mean = (n[0] * up[0][name].double() + n[1] * up[1][name].double()) / sum(n)
        torch.testing.assert_close(value.double(), mean, rtol=1e-5, atol=1e-6)
        # both clients started their last round from the same global model, which is not what they sent
        assert torch.equal(down[0][name], down[1][name])
    assert any(not torch.equal(down[0][k], up[0][k]) for k in final)
    # the audit reads a kept record in the run's own classifier's layout (and one kept per tensor as it is)
    from experiments.audit_targets import RunView, kept_weights

    view = RunView.load(run_dir)
    for got in (kept_weights(view, kept[0].up[ARRAYS_KEY]), kept_weights(view, up[0])):
        assert list(got) == list(like) and all(torch.equal(got[k], up[0][k]) for k in like)
    # the audit attacks this folder as it is, and refuses it for a config it does not hold
    from experiments.privacy_audit import ensure_run

    before = (run_dir / "summary.json").stat().st_mtime_ns
    assert ensure_run(flat, 2) == run_dir and (run_dir / "summary.json").stat().st_mtime_ns == before
    with pytest.raises(ValueError, match="local-epochs differ"):
        ensure_run({**flat, "local-epochs": 2}, 2)


def test_the_leaderboard_reads_the_strongest_attack_per_cell_and_marks_its_front(tmp_path):
    from experiments.leaderboard import AUC, fronts, with_attack_auc
    from fedapp.results import atomic_write_json

    row = lambda acc, auc: {"accuracy": {"mean": acc, "std": 0.0}, AUC: {"mean": auc, "std": 0.0}}  # noqa: E731
    summary = {"A": row(90.0, 0.9), "B": row(80.0, 0.5), "C": row(70.0, 0.6), "D": row(85.0, 0.95)}
    assert fronts(summary)[AUC] == ["B", "A"]  # C is beaten by B on both; D by A
    fig = lambda auc: {"mia_auc": {"value": auc, "low": auc - 0.1, "high": auc + 0.1},  # noqa: E731
                       "mia_tpr_at_1fpr": {"value": 0.0}}
    audit = tmp_path / "audit.json"
    atomic_write_json(audit, {"cells": {"FedAvg": {"0": {"attacks": {"upload/loss": fig(0.8),
                                                                     "global/loss": fig(0.7)}}}}})
    cells = {"FedAvg": {"0": {"accuracy": 90.0}, "1": {"accuracy": 91.0}}, "Espresso": {"0": {"accuracy": 70.0}}}
    got = with_attack_auc(cells, audit)
    assert got["FedAvg"]["0"][AUC] == 0.8 and AUC not in got["FedAvg"]["1"] and AUC not in got["Espresso"]["0"]
    assert with_attack_auc(cells, tmp_path / "none.json") is cells  # not audited: the table reads —


def test_the_settings_json_keeps_every_figure_but_not_the_distances_the_cell_files_hold(tmp_path):
    import argparse
    import json

    from experiments.privacy_audit import figures_of, pooled_near_copies, write_outputs

    members, nonmembers = _features(30, 0), _features(30, 1)
    generated = torch.cat([members[:5], _features(25, 2)])
    recon = pooled_near_copies({0: near_copy_figures(generated, members, nonmembers)})
    scores = {0: (nearest_scores(members, generated), nearest_scores(nonmembers, generated))}
    cells = {"Espresso": {"0": {"attacks": {"upload/nearest": figures_of(scores, 0, 50)}, "reconstruction": recon}}}
    doc = tmp_path / "privacy.md"
    doc.write_text("# page\n")
    a = argparse.Namespace(out=str(tmp_path / "out"), scale="tiny", seeds="0", set=[], cap=200, shadows=4,
                           overfit_epochs=60, resamples=50, doc=str(doc))
    write_outputs(a, [], "s-tiny", cells, {})
    kept = json.loads((tmp_path / "out" / "audit_s-tiny.json").read_text())["cells"]["Espresso"]["0"]
    assert "member_distances" not in kept["reconstruction"] and "nonmember_distances" not in kept["reconstruction"]
    assert kept["reconstruction"]["near_copy_share"] == recon["near_copy_share"] >= 5 / 30  # the planted copies
    assert kept["attacks"] == json.loads(json.dumps(cells["Espresso"]["0"]["attacks"]))
    assert len(cells["Espresso"]["0"]["reconstruction"]["member_distances"]) == 30  # the cell itself is untouched
    assert (tmp_path / "out" / "audit_s-tiny.png").stat().st_size > 0 and "privacy-audit:s-tiny" in doc.read_text()


def test_the_overfitted_control_is_built_on_the_client_with_the_most_members(tmp_path, one_torch_thread,
                                                                              monkeypatch):
    """Under a skewed partition client 0 may hold a handful of images (8 members on mnist-5k at alpha 0.1, seed
    1): the control takes the client whose member sample is the largest."""
    from experiments import audit_targets as T
    from experiments.privacy_audit import CONTROL_OVERFIT, controls

    view = _control_view(tmp_path)
    real = T.candidates(view, 20, 0)
    skewed = {pid: (m.subset(torch.arange(6 if pid != 2 else 20)), n.subset(torch.arange(6 if pid != 2 else 20)))
              for pid, (m, n) in real.items()}
    monkeypatch.setattr(T, "candidates", lambda *a: skewed)
    seen, fit = [], T.overfit_model
    monkeypatch.setattr(T, "overfit_model", lambda v, train, *a: seen.append(train) or fit(v, train, *a))
    got = controls(view, {"cap": 20, "shadows": 2, "overfit_epochs": 2, "resamples": 50}, seed=0)
    assert got[CONTROL_OVERFIT]["client"] == 2 and torch.equal(seen[0].x, skewed[2][0].x)
    assert got[CONTROL_OVERFIT]["attacks"]["upload/loss"]["members"] == 20


def test_the_attack_table_gives_each_seeds_member_count_where_the_seeds_differ():
    from experiments.privacy_audit import attack_table, figures_of, summarise

    def cell(n: int, seed: int) -> dict:
        scores = {0: (nearest_scores(_features(n, seed), _features(20, 9)),
                      nearest_scores(_features(n, seed + 100), _features(20, 9)))}
        return {"attacks": {"upload/nearest": figures_of(scores, seed, 20)}}

    # seeds inserted out of order: the counts read in seed order
    summary = summarise({"uneven": {"1": cell(12, 1), "0": cell(30, 0)}, "even": {"0": cell(25, 0), "1": cell(25, 1)}})
    assert summary["uneven"]["attacks"]["upload/nearest"]["members"] == [30, 12]
    assert summary["uneven"]["attacks"]["upload/nearest"]["fpr_step"] == 1 / 12  # the coarser seed's step
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[7] for line in attack_table(summary).splitlines()[2:]}
    assert rows == {"uneven": "30 + 30, 12 + 12", "even": "25 + 25"}
