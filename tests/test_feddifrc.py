"""FedDifRC: the TDCL/NDCR losses, the diffusion representations (PCA per client, the cache) and an
end-to-end Ray simulation. A tiny random-weight prior (TEST_CONFIG, 2 up-blocks) stands in for the
trained one; shards are capped to a few images per class so feature extraction takes seconds."""

import math

import pytest
import torch

import fedapp
from clients import feddifrc as fd
from clients import feddifrc_targets as T
from fedapp.client_context import ClientContext
from fedapp.config import ConfigError, all_defaults, parse_run_config
from fedapp.models.classifier import ProjectedClassifier
from fedapp.protocols.feddifrc import feddifrc_classifier
from fedapp.models.features import UNetFeatureExtractor
from fedapp.models.prior.tiny import TEST_CONFIG, random_tiny_prior


@pytest.fixture(scope="module")
def prior_dir(tmp_path_factory):
    return random_tiny_prior(TEST_CONFIG, seed=3).save_pretrained(tmp_path_factory.mktemp("prior") / "tiny")


@pytest.fixture(autouse=True)
def small_basis_fit(monkeypatch):
    """Fit the per-pixel PCA on 32 images instead of 128: the tests check what it is fitted on, not its quality."""
    monkeypatch.setattr(T, "FIT_IMAGES", 32)
    monkeypatch.setattr(fd, "_BASES", {})  # each test fits its own (the per-process cache is under test)


def _flat(prior_dir, **kw):
    flat = {"method": "feddifrc", "dataset": "digits", "prior": str(prior_dir), "feddifrc.up-blocks": "0,1",
            "partitioner.name": "dirichlet", "partitioner.alpha": 0.5,
            "partitioner.per-class": 3, "device": "cpu"}
    flat.update(kw)
    return flat


def _ctx(prior_dir, pid=0, n=3, state=None, **kw):
    cfg = parse_run_config({**all_defaults(), **_flat(prior_dir, **kw)})
    return ClientContext(cfg=cfg, partition_id=pid, num_partitions=n, state=state)


# ---- losses --------------------------------------------------------------------------------------
def test_tdcl_is_lowest_when_the_embedding_aligns_with_its_own_class():
    g = torch.Generator().manual_seed(0)
    B, P, D = 6, 5, 12
    F_ = torch.randn(B, P, D, generator=g)
    pos = torch.tensor([0, 1, 2, 3, 4, 2])
    rows = torch.arange(B)
    own = fd.tdcl_loss(F_[rows, pos], F_, pos, tau=0.04)
    for c in range(P):  # z aligned with class c's representation, for every sample
        z = F_[:, c]
        per_sample = [fd.tdcl_loss(z[i:i + 1], F_[i:i + 1], pos[i:i + 1], 0.04) for i in range(B)]
        for i in range(B):
            if c != pos[i]:
                assert per_sample[i] > fd.tdcl_loss(F_[i:i + 1, pos[i]], F_[i:i + 1], pos[i:i + 1], 0.04)
    assert own < fd.tdcl_loss(F_[rows, (pos + 1) % P], F_, pos, 0.04)


def test_tdcl_is_the_papers_log_one_plus_ratio():
    g = torch.Generator().manual_seed(1)
    z, F_ = torch.randn(4, 8, generator=g), torch.randn(4, 3, 8, generator=g)
    pos, tau = torch.tensor([2, 0, 1, 2]), 0.5
    s = torch.nn.functional.cosine_similarity(z.unsqueeze(1), F_, dim=-1)
    want = []
    for i in range(4):
        neg = sum(math.exp(s[i, j] / tau) for j in range(3) if j != pos[i])
        want.append(math.log(1 + neg / math.exp(s[i, pos[i]] / tau)))
    assert fd.tdcl_loss(z, F_, pos, tau).item() == pytest.approx(sum(want) / 4, rel=1e-5)


def test_ndcr_is_zero_when_they_coincide_and_the_squared_distance_otherwise():
    H = torch.randn(5, 7)
    assert fd.ndcr_loss(H.clone(), H).item() == 0.0
    z = H + 0.5
    assert fd.ndcr_loss(z, H, "l2").item() == pytest.approx(7 * 0.25)


@pytest.mark.parametrize("form", ["normalized-l2", "kl"])
def test_normalised_ndcr_forms_ignore_the_scale_of_either_vector(form):
    g = torch.Generator().manual_seed(2)
    z, H = torch.randn(6, 9, generator=g), torch.rand(6, 9, generator=g)
    base = fd.ndcr_loss(z, H, form).item()
    assert base > 0
    for a, b in ((3.0, 1.0), (1.0, 0.01), (50.0, 7.0)):
        assert fd.ndcr_loss(a * z, b * H, form).item() == pytest.approx(base, rel=1e-5)
    # the raw form does not
    assert fd.ndcr_loss(z, H, "l2").item() != pytest.approx(fd.ndcr_loss(3 * z, H, "l2").item())
    assert fd.ndcr_loss(H, 4 * H, form).item() == pytest.approx(0.0, abs=1e-6)


def test_ndcr_kl_is_the_official_codes_divergence():
    g = torch.Generator().manual_seed(3)
    z, H = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    p = torch.softmax(H / H.norm(dim=1, keepdim=True), 1)
    q = torch.softmax(z / z.norm(dim=1, keepdim=True), 1)
    want = (p * (p.log() - q.log())).sum(1).mean()
    assert fd.ndcr_loss(z, H, "kl").item() == pytest.approx(want.item(), rel=1e-5)


# ---- options ------------------------------------------------------------------------------------
def test_options_target_dims_head_and_bad_values():
    cfg = parse_run_config({"method": "feddifrc", "feddifrc.pca-dims": 16, "feddifrc.up-blocks": "1, 2"})
    assert cfg.options.blocks == (1, 2) and cfg.options.target_dims(4, 128) == (16, 16)
    default = parse_run_config({"method": "feddifrc"}).options
    assert default.blocks_for(4) == (1, 2, 3) and default.blocks_for(2) == (0, 1)  # '' = the last three
    assert default.target_dims(4, 512) == (256, 128, 128)  # ResNet-10's feature: the paper's dims
    assert default.target_dims(4, 128) == (64, 32, 32) and default.target_dims(2, 128) == (64, 64)
    assert default.target_dims(4, 130) == (66, 32, 32) and sum(default.target_dims(3, 97)) == 97
    assert default.feature_on == "backbone" and default.head_dim(4, 128) == 0
    head = parse_run_config({"method": "feddifrc", "feddifrc.feature-on": "head", "feddifrc.pca-dims": 8}).options
    assert head.head_dim(4, 128) == 24
    for key, bad in (("up-blocks", "one"), ("ndcr-form", "cosine"), ("pool", "max"), ("feature-on", "logits"),
                     ("pca-dims", 0), ("pca-fit", "server"), ("dynamic-condition", -1.0)):
        with pytest.raises(ConfigError, match=f"feddifrc.{key}"):
            parse_run_config({"method": "feddifrc", f"feddifrc.{key}": bad})


def test_preflight_refuses_backbone_targets_of_the_wrong_size(prior_dir):
    from fedapp.protocols import feddifrc as P

    bad = parse_run_config({**all_defaults(), **_flat(prior_dir, **{"feddifrc.pca-dims": 8})})
    assert "feddifrc.pca-dims=8" in P.preflight(bad) and "128" in P.preflight(bad)
    assert P.preflight(parse_run_config({**all_defaults(), **_flat(
        prior_dir, **{"feddifrc.pca-dims": 8, "feddifrc.feature-on": "head"})})) is None
    assert P.preflight(parse_run_config({**all_defaults(), **_flat(prior_dir)})) is None


def test_prompts_with_and_without_labels():
    names = ["zero", "one"]
    assert T.prompts_for("digits", names, True) == (
        ["a photo of the digit zero", "a photo of the digit one"], "")
    assert T.prompts_for("digits", names, False) == (
        ["a photo of a similar object", "a photo of the digit zero", "a photo of the digit one"],
        "a photo of a visual object")


# ---- representations ----------------------------------------------------------------------------
def _extractor(prior_dir):
    from fedapp.models.prior import load_frozen_prior

    prior = load_frozen_prior(str(prior_dir), "digits", "cpu")
    return UNetFeatureExtractor(prior, t=300, up_blocks=(0, 1), seed=5, batch_size=16)


@pytest.mark.parametrize("pool", ["l2norm", "mean"])
def test_basis_is_a_per_pixel_pca_and_pooling_decides_the_sign(prior_dir, pool):
    ex, ctx = _extractor(prior_dir), _ctx(prior_dir, pid=0)
    x = ctx.shard.train.x
    basis = T.fit_basis(ex, x, ["a photo of the digit one", ""], (6, 40), pool, seed=1)
    for k, (mean, comp) in enumerate(zip(basis.means, basis.components)):
        channels = ex.dims[k]
        assert comp.shape == (min((6, 40)[k], channels), channels) and mean.shape == (channels,)
        assert torch.allclose(comp @ comp.T, torch.eye(len(comp)), atol=1e-4)  # orthonormal components
        # the mean is over pixels: close to the mean of every position of every fitting map
        pix = torch.cat([m[k].flatten(2).transpose(1, 2).reshape(-1, channels)
                         for p in ["a photo of the digit one", ""] for m in ex.maps(x, prompts=p)])
        assert torch.allclose(mean, pix.mean(0), atol=0.15 * pix.std(0).mean().item())
    t = T.reduced(ex, basis, x, "a photo of the digit one")
    assert t.shape == (len(x), 46) and (t[:, 6 + 32:] == 0).all()  # block 1 has 32 channels: zero-padded to 40
    if pool == "l2norm":  # the official pooling: norms, non-negative
        assert (t >= 0).all()
    else:
        assert (t < 0).any()
    # each block has unit RMS norm over the fitting rows
    rows = torch.cat([T.reduced(ex, basis, x, p) for p in ["a photo of the digit one", ""]])
    for sl in (slice(0, 6), slice(6, 46)):
        assert (rows[:, sl] ** 2).sum(1).mean().item() == pytest.approx(1.0, rel=1e-3)


def test_shared_basis_is_fitted_on_the_public_split_only(prior_dir, monkeypatch):
    from feddata import load_server_data

    monkeypatch.setattr(fd, "_CACHE", {})
    seen = []
    real_fit = T.fit_basis
    monkeypatch.setattr(T, "fit_basis", lambda ex, x, *a, **k: seen.append(x) or real_fit(ex, x, *a, **k))
    a, b = _ctx(prior_dir, pid=0), _ctx(prior_dir, pid=1)
    ta, tb = fd.compute_targets(a), fd.compute_targets(b)
    public = load_server_data("digits", "iid", {}, 0, 2, image_size=a.cfg.image_size).public.x
    assert len(seen) == 1 and torch.equal(seen[0], public)  # fitted once for both clients of this process
    assert tb.basis is ta.basis
    client_rows = torch.cat([a.shard.train.x, b.shard.train.x]).flatten(1)
    assert not (torch.cdist(public.flatten(1), client_rows) == 0).any()  # no client image is a fitting row
    for k in range(2):
        assert torch.equal(ta.basis.components[k], tb.basis.components[k])
    # nor does it depend on the run seed (feddifrc.noise-seed fixes eps and the pixel sample), unless asked
    other_seed = _ctx(prior_dir, pid=0, seed=1)
    assert torch.equal(fd.extractor_for(other_seed).noise, fd.extractor_for(a).noise)
    fd._BASES.clear()  # refit, as a fresh process would
    assert torch.equal(fd.compute_targets(other_seed).basis.components[0], ta.basis.components[0])
    assert not torch.equal(fd.extractor_for(_ctx(prior_dir, pid=0, **{"feddifrc.noise-seed": 1})).noise,
                           fd.extractor_for(a).noise)
    seen.clear()
    # one basis per client when asked: fitted on that client's own images
    seen.clear()
    ca = fd.compute_targets(_ctx(prior_dir, pid=0, **{"feddifrc.pca-fit": "client"}))
    cb = fd.compute_targets(_ctx(prior_dir, pid=1, **{"feddifrc.pca-fit": "client"}))
    assert torch.equal(seen[0], a.shard.train.x) and torch.equal(seen[1], b.shard.train.x)
    assert not torch.allclose(ca.basis.components[0], cb.basis.components[0])


def test_targets_shapes_labels_and_self_supervised_positive(prior_dir, fedapp_log, monkeypatch):
    from fedapp import progress
    from fedapp.progress import client_scope

    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)  # a test-sized phase is short: its lines still show
    ctx = _ctx(prior_dir, pid=0)
    with client_scope(0):
        t = fd.compute_targets(ctx)
    n, K, D = len(ctx.shard.train), len(ctx.shard.info.class_names), 128
    assert t.F.shape == (n, K, D) and t.H.shape == (n, D) and torch.equal(t.pos, ctx.shard.train.y)
    # progress in Flower's log stream: a line per prompt (K class prompts + NDCR's; a tenth of 11 is under one)
    said = [r.getMessage().rsplit(",", 1)[0] for r in fedapp_log.records if "target prompts" in r.getMessage()]
    assert said == [f"client 0: target prompts {i}/{K + 1}" for i in range(1, K + 2)]
    ss = fd.compute_targets(_ctx(prior_dir, pid=2, **{"feddifrc.labels": False}))
    assert ss.F.shape[1] == K + 1 and (ss.pos == 0).all()


def test_dynamic_condition_follows_the_local_model(prior_dir):
    ctx = _ctx(prior_dir, pid=0, **{"feddifrc.dynamic-condition": 0.5})
    static, _ = fd.client_targets(ctx)
    torch.manual_seed(0)
    m1 = feddifrc_classifier(ctx.cfg, 10)
    torch.manual_seed(1)
    m2 = feddifrc_classifier(ctx.cfg, 10)
    d1, d1_again, d2 = (fd.dynamic_targets(ctx, static, m) for m in (m1, m1, m2))
    assert torch.equal(d1.F, d1_again.F)  # a function of the model, not of chance
    assert not torch.allclose(d1.F, d2.F, atol=1e-4)  # another model, other conditions, other targets
    assert not torch.allclose(d1.F, static.F, atol=1e-4)
    assert torch.equal(d1.H, static.H)  # NDCR's target stays fixed
    # c_i has the asked norm relative to a prompt token's, and zero offsets give back the static targets
    ex = fd.extractor_for(ctx)
    prompts, _ = T.prompts_for("digits", list(ctx.shard.info.class_names), True)
    tok = T.token_norm(ex.prior, prompts)
    off = T.condition_offsets(m1, ctx.shard.train.x, ex.prior.cond_shape[1], tok, 0.5, seed=3)
    assert torch.allclose(off.norm(dim=1), torch.full((len(off),), 0.5 * tok), rtol=1e-4)
    zero = T.conditioned_targets(ex, static.basis, ctx.shard.train.x, prompts, torch.zeros_like(off))
    assert torch.allclose(zero, static.F, atol=1e-5)


def test_cached_targets_equal_freshly_computed_ones(prior_dir, monkeypatch):
    from flwr.app import RecordDict

    monkeypatch.setattr(fd, "_CACHE", {})
    state = RecordDict()
    ctx = _ctx(prior_dir, pid=1, state=state)
    first, seconds = fd.client_targets(ctx)
    assert seconds > 0 and first.nbytes == 4 * (first.F.numel() + first.H.numel()) + 8 * first.pos.numel()
    again, seconds = fd.client_targets(_ctx(prior_dir, pid=1, state=state))  # process memory
    assert seconds == 0 and again is first
    fd._CACHE.clear()  # a new ClientApp process: the node's Context.state still has them (basis included)
    from_state, seconds = fd.client_targets(_ctx(prior_dir, pid=1, state=state))
    assert seconds == 0 and torch.equal(from_state.basis.components[1], first.basis.components[1])
    fresh = fd.compute_targets(_ctx(prior_dir, pid=1))
    for got in (again, from_state):
        assert torch.equal(got.F, fresh.F) and torch.equal(got.H, fresh.H) and torch.equal(got.pos, fresh.pos)
    # the table command's shared memo gives the same numbers
    monkeypatch.setattr(fd, "SHARE_TARGETS", True)
    monkeypatch.setattr(fd, "_SHARED", {})
    fd.compute_targets(_ctx(prior_dir, pid=0))  # fills the memo with another client's rows first
    shared = fd.compute_targets(_ctx(prior_dir, pid=1))
    assert torch.allclose(shared.F, fresh.F, atol=1e-5) and torch.allclose(shared.H, fresh.H, atol=1e-5)
    # a different timestep or pooling is a different cache entry
    assert fd.cache_key(_ctx(prior_dir, pid=1, **{"feddifrc.t": 100})) != fd.cache_key(ctx)
    assert fd.cache_key(_ctx(prior_dir, pid=1, **{"feddifrc.pool": "mean"})) != fd.cache_key(ctx)


@pytest.mark.parametrize("feature_on", ["backbone", "head"])
def test_regulariser_acts_on_the_chosen_feature_of_the_forward_pass(prior_dir, feature_on):
    extra = {"feddifrc.feature-on": feature_on}
    ctx = _ctx(prior_dir, pid=0, **extra)
    t = fd.compute_targets(ctx)
    model = feddifrc_classifier(ctx.cfg, 10)
    assert isinstance(model, ProjectedClassifier)
    assert any(k.startswith("proj.") for k in model.state_dict()) == (feature_on == "head")
    reg = fd.FedDifRCLoss(t, lambda_tdcl=1.0, lambda_ndcr=1.0, tau=0.04)
    idx = torch.arange(4)
    model(ctx.shard.train.x[idx])
    loss = reg(model, None, None, idx)
    emb = model.embed(ctx.shard.train.x[idx])
    z = emb if feature_on == "backbone" else model.project(emb)
    want = fd.tdcl_loss(z, t.F[idx], t.pos[idx], 0.04) + fd.ndcr_loss(z, t.H[idx], "kl")  # the default form
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    loss.backward()
    assert model.base.features[0][0].weight.grad is not None
    assert set(reg.means()) == {"tdcl", "ndcr"} and reg.means()["ndcr"] > 0


# ---- end to end ----------------------------------------------------------------------------------
def test_feddifrc_simulation_end_to_end(tmp_path, prior_dir, one_actor):
    """Through Ray. small_basis_fit does not reach the actor: it fits on its own shard (pca-fit=client, 30
    images) instead of 128 public ones, which took ~2 min of the test (the public fit: tested in process)."""
    s = fedapp.simulate({**_flat(prior_dir), "num-server-rounds": 1, "local-epochs": 1, "out-dir": str(tmp_path),
                         "min-clients": 2, "feddifrc.pca-fit": "client"}, num_clients=2, backend=one_actor)
    assert s["status"] == "completed" and s["failures"] == []
    assert 0.0 <= s["metrics"]["accuracy"] <= 1.0
    assert set(s["metrics"]["representation_cache_bytes"]) == {"0", "1"}
    assert s["metrics"]["representation_cache_bytes_total"] > 0


def test_a_tiny_prior_not_built_yet_is_built_once_on_the_server_before_any_client_needs_it(tmp_path, monkeypatch):
    """prior = "tiny" on a fresh machine: the server builds it (here a fast stand-in for the 15-minute build)
    in a `prior` phase before round 1, and every client then loads it from the shared cache."""
    import json

    import fedapp.models.prior.tiny as tiny_pkg
    from fedapp.models.prior import resolve_prior, tiny_prior_missing
    from fedapp.simulation import simulate_in_process

    monkeypatch.setenv("FEDAPP_CACHE", str(tmp_path / "cache"))
    builds = []

    def fake_build(dataset, image_size, cache_dir=None, domains=None, **_):
        folder = resolve_prior("tiny", dataset).folder
        random_tiny_prior(TEST_CONFIG, image_size=image_size, seed=3).save_pretrained(folder)
        (folder / "prior_meta.json").write_text(json.dumps({"dataset": dataset}))
        builds.append(dataset)
        return folder

    monkeypatch.setattr(tiny_pkg, "build_tiny_prior", fake_build)
    assert tiny_prior_missing("tiny", "digits")
    s = simulate_in_process({**_flat("tiny"), "num-server-rounds": 1, "local-epochs": 1, "min-clients": 2,
                             "out-dir": str(tmp_path / "runs")}, 2)
    assert s["status"] == "completed" and s["failures"] == []
    assert builds == ["digits"] and "prior" in s["phase_seconds"]
    assert not tiny_prior_missing("tiny", "digits")
    s = simulate_in_process({**_flat("tiny"), "num-server-rounds": 1, "local-epochs": 1, "min-clients": 2,
                             "out-dir": str(tmp_path / "runs")}, 2)
    assert builds == ["digits"] and "prior" not in s["phase_seconds"]  # built once: later runs load it


def test_the_class_signal_of_targets_is_nil_when_prompts_do_not_move_them_and_full_when_they_separate():
    """experiments/feddifrc_signal.py: TDCL's floor at the ideal embedding is log K when every prompt gives the
    same target, near 0 when each class prompt gives its own direction; H~ nearest its own-class target."""
    import math

    from experiments.feddifrc_signal import signal_figures

    g = torch.Generator().manual_seed(0)
    n, k, d = 40, 4, 8
    pos = torch.arange(n) % k
    same = torch.randn(n, 1, d, generator=g).expand(n, k, d)
    flat = signal_figures(same, pos, same[:, 0], tau=0.04)
    assert flat["tdcl_floor"] == pytest.approx(math.log(k), rel=1e-5) and flat["cos_own_other"] == pytest.approx(1.0)
    apart = torch.eye(k, d).expand(n, k, d) + 0.01 * torch.randn(n, k, d, generator=g)
    sep = signal_figures(apart, pos, apart[torch.arange(n), pos], tau=0.04)
    assert sep["tdcl_floor"] < 0.01 and sep["cos_own_other"] < 0.1
    assert sep["prompt_accuracy"] == 1.0 and flat["probe_accuracy_H"] <= 0.6 < sep["probe_accuracy_H"] == 1.0


def test_share_targets_is_the_one_switch_of_the_process_wide_target_memo():
    import clients.feddifrc as fdr

    before = fdr.SHARE_TARGETS
    try:
        fdr.share_targets(1)
        assert fdr.SHARE_TARGETS is True
        fdr.share_targets(False)
        assert fdr.SHARE_TARGETS is False
    finally:
        fdr.share_targets(before)
