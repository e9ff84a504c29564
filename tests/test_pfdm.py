"""PFDM: the LDP bound, the upload (clipped, noised with the variance sigma^2 says), what the server
receives (inspected in a simulation), the private denoiser never leaving the client, and the baselines."""

import math

import numpy as np
import pytest
import torch

from fedapp.privacy import (clip_norm, rdp_orders, forward_diffuse, ldp_epsilon, ldp_sigma2, linear_abar, privatize,
                            resolve_t0, smallest_t0)
from warning_policy import GC_OF_EARLIER_LEAKS

TINY = {"dataset": "colored-digits", "partitioner": "minority", "partitioner.per-class": 0, "image-size": 8,
        "min-clients": 2, "num-server-rounds": 1, "pfdm.local-steps": 3, "pfdm.shared-steps": 3, "pfdm.samples": 30,
        "pfdm.sample-steps": 3, "pfdm.attack-samples": 20, "pfdm.ref-epochs": 1, "pfdm.batch": 16}


def residual_figures(x_up: torch.Tensor, x: torch.Tensor, clip: float, t0: int) -> tuple[float, float]:
    """For uploads x~ of images x: (var(r) / (1 - abar_t0), mean of <r, x/||x||> in noise-sd units) with
    r = x~ - sqrt(abar_t0) CLIP(x). A correct upload gives (~1, ~0); an unclipped one has a mean along x."""
    a = float(linear_abar()[t0])
    r = (x_up - math.sqrt(a) * clip_norm(x, clip)).flatten(1).double()
    u = x.flatten(1).double()
    u = u / u.norm(dim=1, keepdim=True)
    return float(r.var() / (1 - a)), float((r * u).sum(1).mean() / math.sqrt(1 - a))


def test_clip_bounds_the_norm_and_leaves_small_images_alone():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 8, 8, generator=g) * torch.linspace(0.05, 3, 64).view(-1, 1, 1, 1)
    c = clip_norm(x, 5.0)
    norms, orig = c.flatten(1).norm(dim=1), x.flatten(1).norm(dim=1)
    assert (norms <= 5.0 + 1e-5).all()
    small = orig <= 5.0
    assert small.any() and torch.allclose(c[small], x[small])
    assert torch.allclose(norms[~small], torch.full_like(norms[~small], 5.0))


def test_upload_noise_has_the_variance_sigma2_says():
    # x~ / sqrt(abar) = CLIP(x) + N(0, sigma^2): check the residual's variance and zero mean along x
    g = torch.Generator().manual_seed(1)
    x = torch.rand(3000, 3, 8, 8, generator=g) * 2 - 1  # ||x|| ~ 8 > C = 5: every image is clipped
    for t0 in (100, 693):
        up = privatize(x, 5.0, t0, g)
        var_ratio, along = residual_figures(up, x, 5.0, t0)
        n = up.numel()
        assert abs(var_ratio - 1) < 5 * math.sqrt(2 / n)
        assert abs(along) < 5 / math.sqrt(len(x))
        a = linear_abar()[t0]
        rescaled = (up / math.sqrt(a) - clip_norm(x, 5.0)).double()
        assert abs(rescaled.var().item() / ldp_sigma2(t0) - 1) < 5 * math.sqrt(2 / n)
    # the check has power: an upload of the unclipped image is caught
    bad = forward_diffuse(x, 693, torch.randn(x.shape, generator=g))
    assert residual_figures(bad, x, 5.0, 693)[1] > 10 / math.sqrt(len(x))


def test_epsilon_matches_theorem_5_1_and_falls_with_t0():
    abar = linear_abar()
    assert abar[0] == 1 and np.isclose(abar[1], 1 - 1e-4)
    for t0, c, d in [(690, 10.0, 1e-5), (300, 1.0, 1e-3), (900, 25.0, 1e-6)]:
        s2 = (1 - abar[t0]) / abar[t0]
        assert ldp_epsilon(t0, c, d) == pytest.approx(2 * c * c / s2 + c * math.sqrt(8 * math.log(1 / d) / s2))
    eps = [ldp_epsilon(t, 10.0, 1e-5) for t in range(1, 1001)]
    assert all(a > b for a, b in zip(eps, eps[1:]))
    assert ldp_epsilon(0, 10.0, 1e-5) == math.inf
    # the paper's example: T = 1000, linear, C = 10, t0 = 690, delta = 1e-5 -> "epsilon = 10"; exactly 10.243
    assert ldp_epsilon(690, 10.0, 1e-5) == pytest.approx(10.2429, abs=1e-4)
    # the toolkit DDPM uses the same levels
    from fedapp.models.ddpm import DDPM

    m = DDPM(image_size=8, block_out_channels=(8, 16), attention=False)
    assert np.allclose(m.abar.double().numpy(), abar, rtol=1e-5)


def test_target_epsilon_picks_the_smallest_sufficient_t0():
    for target, c, d in [(10.0, 10.0, 1e-5), (1.0, 1.0, 1e-5), (50.0, 10.0, 1e-5), (3.0, 2.0, 1e-3)]:
        t0 = smallest_t0(target, c, d)
        assert ldp_epsilon(t0, c, d) <= target < ldp_epsilon(t0 - 1, c, d)
    assert smallest_t0(10.0, 10.0, 1e-5) == 693
    assert resolve_t0(690, 10.0, 10.0, 1e-5) == 690 and resolve_t0(0, 10.0, 10.0, 1e-5) == 693
    with pytest.raises(ValueError, match="pfdm.epsilon"):
        smallest_t0(1e-3, 10.0, 1e-5)


def test_tight_accountants_beside_the_papers_bound():
    """One Gaussian release at t0 = 693, C = 10, delta = 1e-5: the paper's bound 9.996 against the
    tight RDP (9.19) and PLD (8.55) accountants; a tighter accountant meets epsilon = 10 with less noise."""
    from fedapp.privacy import accountant_epsilon, privacy_record

    eps = {a: accountant_epsilon(693, 10.0, 1e-5, a) for a in ("bound", "rdp", "pld")}
    assert eps["bound"] == pytest.approx(9.9959, abs=1e-3)
    assert eps["rdp"] == pytest.approx(9.19, abs=0.01) and eps["pld"] == pytest.approx(8.55, abs=0.01)
    t_bound, t_rdp, t_pld = (smallest_t0(10.0, 10.0, 1e-5, a) for a in ("bound", "rdp", "pld"))
    assert t_bound == 693 and t_pld < t_rdp < t_bound
    for a, t in (("rdp", t_rdp), ("pld", t_pld)):  # the smallest t0: one step less breaks the budget
        assert accountant_epsilon(t, 10.0, 1e-5, a) <= 10.0 < accountant_epsilon(t - 1, 10.0, 1e-5, a)
    rec = privacy_record(t_rdp, 10.0, 1e-5, "rdp")
    assert rec["accountant"] == "rdp" and rec["epsilon"] == rec["epsilon_by_accountant"]["rdp"] <= 10.0
    assert rec["epsilon_by_accountant"]["bound"] > 10.0  # what the paper's bound says of the same release


def test_the_privacy_record_of_the_lowest_level_is_computed_not_a_memory_error():
    """t0 = 1 (the ε curve's "inf" point): PLD's default grid would need 301 GiB; with the grid step scaled
    to the bound every accountant answers: PLD just below the bound (measured 2.0083e6 vs 2.0094e6)."""
    from fedapp.privacy import privacy_record

    by = privacy_record(1, 10.0, 1e-5)["epsilon_by_accountant"]
    assert by["bound"] == pytest.approx(2.0094e6, rel=1e-3)
    assert by["pld"] <= by["bound"] and by["pld"] == pytest.approx(by["bound"], rel=0.01)
    assert by["rdp"] == pytest.approx(2.1999e6, rel=1e-3)  # RDP's conversion is looser than the bound here


def test_private_training_set_and_upload_order():
    from clients.pfdm import make_upload, private_training_set, split_steps

    x = torch.rand(10, 3, 8, 8) * 2 - 1
    y = torch.arange(10)
    xs, ys, flags = private_training_set(x, y, 2.0)
    assert len(xs) == 20 and (flags[:10] == 0).all() and (flags[10:] == 1).all()
    assert torch.equal(xs[:10], x) and (xs[10:].flatten(1).norm(dim=1) <= 2.0 + 1e-5).all()
    up, yu = make_upload(x, y, 2.0, 500)
    assert up.shape == x.shape and torch.equal(yu, y)
    assert split_steps(50, 693) == (15, 35) and split_steps(2, 999) == (1, 1)


def test_per_sample_loss_and_training_loop():
    from fedapp.models.ddpm import build_ddpm, train_ddpm

    m = build_ddpm(8, 3, channels="8,16")
    x, y = torch.rand(12, 3, 8, 8) * 2 - 1, torch.arange(12) % 3
    per = m.loss(x, y, generator=torch.Generator().manual_seed(0), reduction="none")
    full = m.loss(x, y, generator=torch.Generator().manual_seed(0))
    assert per.shape == (12,) and torch.isclose(per.mean(), full, rtol=1e-4)
    assert math.isfinite(train_ddpm(m, x, y, steps=3, batch=4, t_range=(600, 1000), source_t=600))


def test_pfdm_simulation_uploads_are_private_and_the_private_model_stays_home(tmp_path):
    import fedapp
    from fedapp.protocols import pfdm as P
    from feddata import load_client_shard

    dump = tmp_path / "messages"
    dump.mkdir()

    def capture(msg, context, call_next):
        # runs on the client: what the server sends, what it gets back, and the private model after the call
        reply = call_next(msg, context)
        pid = int(context.node_config["partition-id"])
        arrays = lambda rd: {f"{k}/{n}": a.numpy() for k, rec in rd.array_records.items()  # noqa: E731
                             for n, a in rec.items()}
        private = {n: a.numpy() for n, a in context.state.array_records[P.STATE_PRIVATE].items()} \
            if P.STATE_PRIVATE in context.state.array_records else {}
        torch.save({"in": arrays(msg.content), "out": arrays(reply.content) if reply.has_content() else {},
                    "private": private}, dump / f"{msg.metadata.message_type}-{pid}.pt")
        return reply

    s = fedapp.simulate({**TINY, "method": "pfdm", "out-dir": str(tmp_path)}, num_clients=2, client_mods=[capture])
    assert s["status"] == "completed" and s["failures"] == []
    p = s["privacy"]
    assert p["t0"] == 693 and p["clip"] == 10.0 and p["delta"] == 1e-5 and p["epsilon"] <= 10.0
    m = s["metrics"]
    for key in ("majority_distance", "minority_distance", "mean_distance", "mia_auc", "mia_tpr_at_1fpr",
                "shared_memorised_fraction", "recon_closer_than_random", "minority_kid", "minority_kid_std",
                "private_only_minority_kid", "mean_kid", "t0_kid", "t0_kid_reference"):
        assert m[key] is not None and math.isfinite(m[key]), key
    for key in ("minority_sample_accuracy", "private_only_minority_sample_accuracy", "majority_sample_accuracy"):
        assert 0.0 <= m[key] <= 1.0, key  # each class group's reading, of the released and the private-only model
    assert set(m["per_client"]) == {"0", "1"}
    # the reference classifier is a reader: its held-out accuracy, and whether it is below its threshold
    assert m["reader_accuracy"] == {"label": m["reference_accuracy"]}
    assert m["reader_unreliable"] == (m["unreliable_readers"] == ["label"])

    for pid in (0, 1):
        up = torch.load(dump / f"train-{pid}.pt", weights_only=False)
        upload_x, upload_y = f"{P.UPLOAD_KEY}/{P.X}", f"{P.UPLOAD_KEY}/{P.Y}"
        assert set(up["out"]) == {upload_x, upload_y}  # the only arrays the server receives in phase 1
        shard = load_client_shard("colored-digits", "minority", {"minority-classes": 2, "minority-fraction": 0.1,
                                                                 "per-class": 0}, 0, pid, 2, image_size=8)
        x_up = torch.from_numpy(up["out"][upload_x])
        var_ratio, along = residual_figures(x_up, shard.train.x, 10.0, 693)
        assert abs(var_ratio - 1) < 5 * math.sqrt(2 / x_up.numel())  # noised with sigma^2's variance
        assert abs(along) < 5 / math.sqrt(len(x_up))  # clipped: no leftover signal along x beyond C
        a = float(linear_abar()[693])
        assert (clip_norm(shard.train.x, 10.0) * math.sqrt(a)).flatten(1).norm(dim=1).max() <= math.sqrt(a) * 10 + 1e-4
        # the private denoiser's weights appear in no message, in either direction, in any phase
        private = torch.load(dump / f"{P.SAMPLE.message_type}-{pid}.pt", weights_only=False)["private"]
        assert private, "the private model should live in the node's Context.state"
        for phase in (P.TRAIN.message_type, P.SAMPLE.message_type):
            rec = torch.load(dump / f"{phase}-{pid}.pt", weights_only=False)
            for name, arr in {**rec["in"], **rec["out"]}.items():
                for pname, w in private.items():
                    if w.size > 1 and arr.size >= w.size:
                        flat = arr.reshape(-1)
                        assert not (arr.shape == w.shape and np.allclose(arr, w)), (name, pname)
                        assert not np.isin(w.reshape(-1)[:16], flat).all(), (name, pname)


def test_generation_baseline_reports_the_same_metric_names(tmp_path):
    # centralized-ddpm only: the cheapest baseline run (local-only and fedavg-ddpm run in the experiment)
    import fedapp

    s = fedapp.simulate({**TINY, "method": "centralized-ddpm", "out-dir": str(tmp_path)}, num_clients=2)
    assert s["status"] == "completed"
    for key in ("majority_distance", "minority_distance", "mean_distance", "mia_auc", "mia_tpr_at_1fpr"):
        assert math.isfinite(s["metrics"][key]), key


@pytest.mark.filterwarnings(GC_OF_EARLIER_LEAKS)
@pytest.mark.filterwarnings("error")  # a run prints no warning, fedapp's or a library's
@pytest.mark.parametrize("method", ["local-only", "fedavg-ddpm", "dpdm"])
def test_ddpm_baselines_protocols_on_an_in_process_grid(tmp_path, method):
    """strategies/ddpm_baselines.py: local-only releases nothing (no MIA target, samples only);
    fedavg-ddpm moves the whole DDPM each round and its released global model is attacked."""
    from fedapp.models.ddpm import build_ddpm
    from fedapp.simulation import simulate_in_process
    from strategies.ddpm_baselines import NO_MIA

    extra = {"pfdm.dp-noise": 1.0} if method == "dpdm" else {}  # calibrating it is tested on the client alone
    s = simulate_in_process({**TINY, **extra, "method": method, "out-dir": str(tmp_path), "run-name": method}, 2)
    assert s["status"] == "completed" and s["failures"] == []
    m = s["metrics"]
    # local-only: one sample set per client; fedavg-ddpm: one released model, scored once (as client 0)
    assert set(m["per_client"]) == ({"0", "1"} if method == "local-only" else {"0"})
    if method == "dpdm":  # the worst client's spend, below the target the multiplier was picked for
        assert math.isfinite(m["dp_epsilon"]) and m["dp_epsilon"] > 0 and m["dp_noise_multiplier_max"] == 1.0
    assert all(math.isfinite(m[k]) for k in ("majority_distance", "minority_distance", "mean_distance"))
    assert m["reader_accuracy"] == {"label": m["reference_accuracy"]} and isinstance(m["reader_unreliable"], bool)
    per = s["comm"]["per_client"]
    if method == "local-only":
        assert {k: m[k] for k in NO_MIA} == NO_MIA
        assert all(p["messages_down"] == 1 and p["messages_up"] == 1 for p in per.values())
    else:
        assert math.isfinite(m["mia_auc"])
        from safetensors.torch import load_file

        saved = load_file(f"{s['run_dir']}/model.safetensors")  # the released global DDPM
        assert saved.keys() == build_ddpm(8, 10, flag=False).state_dict().keys()
        model_bytes = sum(a.numel() * a.element_size() for a in build_ddpm(8, 10, flag=False).state_dict().values())
        assert all(p["up_bytes"] >= model_bytes * TINY["num-server-rounds"] for p in per.values())


def test_upload_noise_comes_from_the_os_so_the_server_cannot_subtract_it():
    """Two releases of the same data under the same run seed differ, and the server's best use of
    everything it knows (seed, config, labels: the old seeded generator) leaves the full noise in place."""
    from clients.pfdm import make_upload
    from fedapp.seeds import derive_seed

    x = torch.rand(64, 3, 8, 8) * 2 - 1
    y = torch.arange(64) % 10
    clip, t0 = 10.0, 693
    a = float(linear_abar()[t0])
    up1, _ = make_upload(x, y, clip, t0)
    up2, _ = make_upload(x, y, clip, t0)
    assert not torch.equal(up1, up2)
    truth = clip_norm(x, clip)
    for seed in (derive_seed(0, 0, 2), 0, 1):  # what a seeded client would have used
        guess = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
        recon = (up1 - math.sqrt(1 - a) * guess) / math.sqrt(a)
        err = (recon - truth).flatten(1).norm(dim=1)
        # residual = sqrt((1-a)/a) * (z - guess): norm ~ sqrt(2 sigma^2 d), never the old 3e-6
        expected = math.sqrt(2 * ldp_sigma2(t0) * x[0].numel())
        assert err.mean() > 0.8 * expected
    noise = (up1 - math.sqrt(a) * truth) / math.sqrt(1 - a)
    assert abs(noise.mean()) < 0.05 and abs(noise.std() - 1) < 0.05  # standard normal, as the bound assumes


def test_two_runs_with_one_seed_differ_in_the_upload_noise_and_nothing_else(tmp_path):
    """Same config, same seed: the released x~ differ (fresh OS noise), labels and everything the seed
    decides (the private denoiser, hence its private-only samples) are identical."""
    from fedapp.protocols import pfdm as P
    from fedapp.server_app import run_server
    from fedapp.simulation import InProcessGrid, resolve_run_config

    class _Recording(InProcessGrid):
        def __init__(self, n):
            super().__init__(n)
            self.replies = {}

        def deliver(self, msg):
            reply = super().deliver(msg)
            pid = self.nodes[msg.metadata.dst_node_id].node_config["partition-id"]
            self.replies[(msg.metadata.message_type, pid)] = reply.content
            return reply

    runs = []
    for name in ("a", "b"):
        flat, _ = resolve_run_config({**TINY, "method": "pfdm", "out-dir": str(tmp_path), "run-name": name}, 2)
        grid = _Recording(2)
        run_server(grid, flat)
        runs.append(grid.replies)
    a, b = runs
    for pid in (0, 1):
        up_a, up_b = (r[("train", pid)].array_records[P.UPLOAD_KEY] for r in (a, b))
        assert not np.array_equal(up_a[P.X].numpy(), up_b[P.X].numpy())
        assert np.array_equal(up_a[P.Y].numpy(), up_b[P.Y].numpy())
        s_a, s_b = (r[("query.sample", pid)].array_records[P.SAMPLES_KEY] for r in (a, b))
        assert np.array_equal(s_a[P.PRIVATE_ONLY].numpy(), s_b[P.PRIVATE_ONLY].numpy())


@pytest.mark.parametrize("mode", ["below-t0", "all"])
def test_private_denoiser_trains_only_on_the_levels_pfdm_samples_it_on(monkeypatch, mode):
    from clients.pfdm import private_levels, train_private_denoiser
    from fedapp.protocols.pfdm import PFDMOptions

    t0 = 693
    seen = record_levels(monkeypatch)  # every level the network is trained on
    o = PFDMOptions(local_steps=20, batch=64, channels="8,16", private_levels=mode)
    x, y = torch.rand(32, 3, 8, 8) * 2 - 1, torch.arange(32) % 4
    train_private_denoiser(x, y, o, 8, 4, t0, seed=0)
    t = torch.cat(seen)
    assert len(t) == 20 * 64 and t.min() >= 1
    if mode == "below-t0":
        assert t.max() <= t0 and private_levels(mode, t0, 1000) == (0, t0)
    else:  # (0, T]: 1280 uniform draws, P(none above t0) = 0.693^1280
        assert t.max() > t0 and private_levels(mode, t0, 1000) == (0, 1000)
    with pytest.raises(ValueError, match="below-t0, all"):
        private_levels("below_t0", t0, 1000)


def record_levels(monkeypatch) -> list:
    """Every level DDPM.eps is called at, from now on (training draws and sampling steps alike)."""
    from fedapp.models.ddpm import DDPM

    seen, eps = [], DDPM.eps

    def recording_eps(self, x_t, t, *args, **kwargs):
        seen.append(torch.as_tensor(t).flatten())
        return eps(self, x_t, t, *args, **kwargs)

    monkeypatch.setattr(DDPM, "eps", recording_eps)
    return seen


@pytest.mark.parametrize("mode", ["algorithm2", "relative"])
def test_shared_denoiser_objective_and_sampling_range(monkeypatch, mode):
    from types import SimpleNamespace

    from fedapp.models.ddpm import DDPM, shared_sample
    from fedapp.protocols.pfdm import PFDMOptions
    from strategies.pfdm import PFDMStrategy

    t0 = 693
    calls = []
    loss = DDPM.loss

    def recording_loss(self, x0, *args, **kwargs):
        calls.append((x0, kwargs["t_range"], kwargs["source_t"]))
        return loss(self, x0, *args, **kwargs)

    monkeypatch.setattr(DDPM, "loss", recording_loss)
    seen = record_levels(monkeypatch)
    strategy = PFDMStrategy.__new__(PFDMStrategy)  # train_shared alone: no grid, no clients
    strategy.t0 = t0
    strategy.run = SimpleNamespace(device="cpu", out=SimpleNamespace(log_metrics=lambda m: None),
                                   cfg=SimpleNamespace(seed=0, image_size=8, run_name="", options=PFDMOptions(
                                       shared_steps=20, batch=64, channels="8,16", shared=mode)))
    x_up, y_up = privatize(torch.rand(64, 3, 8, 8) * 2 - 1, 10.0, t0), torch.arange(64) % 4
    shared = strategy.train_shared(x_up, y_up, 4)
    trained = torch.cat(seen)
    assert len(calls) == 20 and all(((c[0][:, None] == x_up[None]).flatten(2).all(2).any(1)).all() for c in calls)
    if mode == "algorithm2":  # a standard DDPM on x~: every level (0, T], the plain eps target
        assert {(c[1], c[2]) for c in calls} == {((0, 1000), None)}
        assert trained.min() <= t0 < trained.max()
        g, x, y = torch.Generator().manual_seed(1), x_up[:8], y_up[:8]
        t = torch.randint(1, 1001, (8,), generator=g)
        noise = torch.randn(x.shape, generator=g)
        want = torch.nn.functional.mse_loss(shared.eps(shared.add_noise(x, noise, t), t, y), noise)
        assert torch.allclose(loss(shared, x, y, t_range=(0, 1000), generator=torch.Generator().manual_seed(1)), want)
    else:  # levels above t0 only, the uploads taken as x_t0
        assert {(c[1], c[2]) for c in calls} == {((t0, 1000), t0)} and trained.min() > t0

    seen.clear()
    x_t0 = shared_sample(shared, torch.arange(6) % 4, t0, mode, 10, torch.Generator().manual_seed(2))
    sampled = torch.cat(seen)
    assert x_t0.shape == (6, 3, 8, 8) and sampled.max() == 1000
    # algorithm2 runs z_w over all T levels (its output is an x~); relative stops at t0
    assert (sampled.min() < t0) if mode == "algorithm2" else (sampled.min() > t0)


def test_t0_match_scores_an_exact_level_t0_marginal_like_held_out_data_and_a_wrong_one_worse():
    """z_w's hand-over check: samples that are another release of the same data score about the reference
    (releases of other held-out data) and pass; releases of images with a different mean, or 20 % too loud,
    fail. (An exact z_w sampled through each pfdm.handover: tests/test_pfdm_handover.py.)"""
    from strategies.pfdm import t0_match_figures

    t0, clip = 200, 10.0
    g = torch.Generator().manual_seed(0)
    data = lambda n: (torch.rand(n, 3, 8, 8, generator=g) * 2 - 1) * 0.5  # noqa: E731
    real = privatize(data(200), clip, t0, g)
    held_out = [privatize(data(200), clip, t0, g) for _ in range(5)]
    exact = t0_match_figures(privatize(data(200), clip, t0, g), real, held_out)
    wrong = t0_match_figures(privatize(data(200) + 0.2, clip, t0, g), real, held_out)
    ref, spread = exact["t0_kid_reference"], exact["t0_kid_reference_std"]
    assert abs(ref) < 0.01 and 0 < spread < 0.01 and abs(exact["t0_kid"] - ref) < 3 * spread
    assert abs(exact["t0_energy_ratio"] - 1) < 0.05 and abs(exact["t0_energy_ratio_reference"] - 1) < 0.05
    assert exact["t0_handover_ok"] == 1.0
    assert wrong["t0_kid"] > ref + 10 * spread and wrong["t0_handover_ok"] == 0.0
    loud = t0_match_figures(privatize(data(200), clip, t0, g) * 1.2, real, held_out)  # 20% too much amplitude
    assert abs(loud["t0_energy_ratio"] - 1.44) < 0.1 and loud["t0_handover_ok"] == 0.0


# ---- dpdm: FedAvg over a DDPM trained with DP-SGD (Opacus) ------------------------------------------
@pytest.mark.filterwarnings(GC_OF_EARLIER_LEAKS)
@pytest.mark.filterwarnings("error")
def test_dpdm_client_reports_opacus_epsilon_for_its_noise_rate_and_steps_so_far():
    """A client's round-r reply: epsilon is Opacus' RDP accountant stepped once per DP-SGD step of rounds
    1..r at its noise multiplier and sampling rate; the multiplier picked for pfdm.epsilon spends (about)
    all of it by the last round."""
    from types import SimpleNamespace

    from flwr.app import ConfigRecord, RecordDict
    from opacus.accountants import RDPAccountant

    from clients import dpdm
    from fedapp.client_context import ClientContext
    from fedapp.config import all_defaults, parse_run_config
    from fedapp.models.ddpm import build_ddpm
    from fedapp.protocols import ARRAYS_KEY, METRICS_KEY, ROUND_KEY, RUN_KEY
    from fedapp.protocols import pfdm as P
    from fedapp.protocols.weights import weights_record

    flat = {**{("partitioner.name" if k == "partitioner" else k): v for k, v in TINY.items()}, "method": "dpdm",
            "num-server-rounds": 2, "pfdm.local-steps": 4, "pfdm.batch": 4, "pfdm.epsilon": 5.0}
    ctx = ClientContext(cfg=parse_run_config({**all_defaults(), **flat}), partition_id=0, num_partitions=2)
    n = len(ctx.shard.train)
    steps, q, sigma = dpdm.round_plan(n, ctx.cfg.options, 2)
    assert steps == 2 and q == 4 / n < 1 and sigma > 0
    weights = weights_record(build_ddpm(8, ctx.shard.info.num_classes).state_dict())  # packed, as the server sends
    acc = RDPAccountant()
    for rnd in (1, 2):
        msg = SimpleNamespace(content=RecordDict({ARRAYS_KEY: weights, RUN_KEY: ConfigRecord({ROUND_KEY: rnd})}))
        reply = dpdm.handle_train(msg, ctx)
        for _ in range(steps):
            acc.step(noise_multiplier=sigma, sample_rate=q)
        m = reply[METRICS_KEY]
        assert m[P.DP_EPSILON_METRIC] == pytest.approx(acc.get_epsilon(ctx.cfg.options.delta, alphas=rdp_orders()),
                                                       rel=1e-9)
        assert m[P.DP_NOISE_METRIC] == sigma
        weights = reply[ARRAYS_KEY]
    assert 4.5 < m[P.DP_EPSILON_METRIC] <= 5.0 + 1e-6


def test_dpdm_randomness_beyond_the_seed_is_the_dp_mechanisms_own():
    """Same data and seed: with every sample taken (rate 1) and no noise, two runs agree to the bit; with
    Poisson sampling or noise they differ (drawn from OS-seeded generators the server cannot replay)."""
    from clients.dpdm import train_ddpm_dpsgd
    from fedapp.models.ddpm import build_ddpm

    x, y = torch.rand(8, 3, 8, 8) * 2 - 1, torch.arange(8) % 10

    def weights(rate: float, noise: float) -> torch.Tensor:
        torch.manual_seed(0)
        m = build_ddpm(8, 10)
        train_ddpm_dpsgd(m, x, y, steps=2, sample_rate=rate, noise_multiplier=noise, max_grad_norm=1.0, lr=1e-3,
                         seed=0)
        return torch.cat([p.detach().flatten() for p in m.parameters()])

    assert torch.equal(weights(1.0, 0.0), weights(1.0, 0.0))
    # a rate so small that every Poisson batch is empty: each step is noise alone, and it still moves
    torch.manual_seed(0)
    initial = torch.cat([p.detach().flatten() for p in build_ddpm(8, 10).parameters()])
    assert not torch.equal(weights(1e-9, 1.0), initial)
    assert not torch.equal(weights(1.0, 1.0), weights(1.0, 1.0))
    assert not torch.equal(weights(0.5, 0.0), weights(0.5, 0.0))


@pytest.mark.filterwarnings(GC_OF_EARLIER_LEAKS)
@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("epsilon, q, steps", [(10.0, 0.1, 3), (100.0, 0.2, 10), (1.0, 0.01, 1000)])
def test_dpsgd_accounting_finds_its_best_order_inside_the_range_it_searches(epsilon, q, steps):
    """Opacus warns (and reports a looser epsilon) when the best RDP order is an end of the range it is given:
    few steps or much noise want orders above its default 63, epsilon ~100 orders below 1.1."""
    from fedapp.privacy import dpsgd_epsilon, dpsgd_noise_multiplier

    sigma = dpsgd_noise_multiplier(epsilon, 1e-5, q, steps)
    assert 0.9 * epsilon < dpsgd_epsilon(sigma, q, steps, 1e-5) <= epsilon * (1 + 1e-3)
    assert min(rdp_orders()) < 1.1 and max(rdp_orders()) > 63


@pytest.mark.parametrize("method, trainers", [
    ("pfdm", {"clients.pfdm", "strategies.pfdm", "strategies.pfdm_attacks"}),
    ("centralized-ddpm", {"strategies.ddpm_baselines"}),
    ("local-only", {"clients.ddpm_baselines"}),
    ("fedavg-ddpm", {"clients.ddpm_baselines"}),
])
def test_ema_and_label_dropout_reach_every_denoiser_of_a_run(tmp_path, monkeypatch, method, trainers):
    """pfdm.ema and pfdm.p-uncond (the budget sweep's recipe, experiments/pfdm_budget.py) reach every
    train_ddpm call of the table's rows: private denoisers and their references, z_w, the attacker, the baselines."""
    import importlib

    from fedapp.models import ddpm
    from fedapp.simulation import simulate_in_process

    calls = []
    for name in ("clients.pfdm", "clients.ddpm_baselines", "strategies.pfdm", "strategies.ddpm_baselines",
                 "strategies.pfdm_attacks"):
        def recording(*args, _module=name, **kwargs):
            calls.append((_module, kwargs.get("ema", 0.0), kwargs.get("p_uncond", 0.0)))
            return ddpm.train_ddpm(*args, **kwargs)
        monkeypatch.setattr(importlib.import_module(name), "train_ddpm", recording)
    s = simulate_in_process({**TINY, "method": method, "pfdm.ema": 0.5, "pfdm.p-uncond": 0.25,
                             "out-dir": str(tmp_path), "run-name": method}, 2)
    assert s["status"] == "completed"
    assert {m for m, _, _ in calls} == trainers
    assert calls and all((ema, p) == (0.5, 0.25) for _, ema, p in calls), calls


def test_ema_must_be_below_one():
    from fedapp.config import ConfigError, parse_run_config

    assert parse_run_config({"method": "pfdm"}).options.ema == 0.0  # default: the tables before it, unchanged
    with pytest.raises(ConfigError, match="pfdm.ema=1.0: must be < 1"):
        parse_run_config({"method": "pfdm", "pfdm.ema": 1.0})
