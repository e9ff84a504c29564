"""FedDifRC: the TDCL/NDCR losses, the diffusion representations (PCA per client, the cache) and an
end-to-end Ray simulation. A tiny random-weight prior (TEST_CONFIG, 2 up-blocks) stands in for the
trained one; shards are capped to a few images per class so feature extraction takes seconds."""

import math

import pytest
import torch

import fedapp

ONE_ACTOR = {"client_resources": {"num_cpus": 2, "num_gpus": 0.0}}  # one Ray actor: one torch import on 2 cores
from clients import feddifrc as fd
from fedapp.client_context import ClientContext
from fedapp.config import ConfigError, all_defaults, parse_run_config
from fedapp.models.classifier import ProjectedClassifier, build_classifier
from fedapp.models.features import UNetFeatureExtractor
from fedapp.models.prior.tiny import TEST_CONFIG, random_tiny_prior


@pytest.fixture(scope="module")
def prior_dir(tmp_path_factory):
    return random_tiny_prior(TEST_CONFIG, seed=3).save_pretrained(tmp_path_factory.mktemp("prior") / "tiny")


def _flat(prior_dir, **kw):
    flat = {"method": "feddifrc", "dataset": "digits", "prior": str(prior_dir), "feddifrc.up-blocks": "0,1",
            "feddifrc.pca-dims": 8, "partitioner.name": "dirichlet", "partitioner.alpha": 0.5,
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
    assert fd.ndcr_loss(z, H).item() == pytest.approx(7 * 0.25)


# ---- representations ----------------------------------------------------------------------------
def test_options_projection_dim_and_bad_up_blocks():
    cfg = parse_run_config({"method": "feddifrc", "feddifrc.pca-dims": 16, "feddifrc.up-blocks": "1, 2"})
    assert cfg.options.blocks == (1, 2) and cfg.options.projection_dim(4) == 32
    default = parse_run_config({"method": "feddifrc"}).options
    assert default.projection_dim(4) == 32 * 3 and default.blocks_for(4) == (1, 2, 3)  # '' = the last three
    assert default.blocks_for(2) == (0, 1) and default.projection_dim(2) == 32 * 2  # a shallower prior: all it has
    with pytest.raises(ConfigError, match="feddifrc.up-blocks"):
        parse_run_config({"method": "feddifrc", "feddifrc.up-blocks": "one"})


def test_prompts_with_and_without_labels():
    names = ["zero", "one"]
    assert fd.prompts_for("digits", names, True) == (
        ["a photo of the digit zero", "a photo of the digit one"], "")
    assert fd.prompts_for("digits", names, False) == (
        ["a photo of a similar object", "a photo of the digit zero", "a photo of the digit one"],
        "a photo of a visual object")


def test_pca_is_fitted_on_the_clients_own_data_only(prior_dir):
    a, b = _ctx(prior_dir, pid=0), _ctx(prior_dir, pid=1)
    prior = fd.load_frozen_prior(str(prior_dir), "digits", "cpu")
    ex = UNetFeatureExtractor(prior, t=300, up_blocks=(0, 1), seed=5)
    names = list(a.shard.info.class_names)
    ta = fd.diffusion_targets(ex, a.shard.train.x, a.shard.train.y, "digits", names, True, 8)
    tb = fd.diffusion_targets(ex, b.shard.train.x, b.shard.train.y, "digits", names, True, 8)
    prompts, generic = fd.prompts_for("digits", names, True)
    for blk in range(2):  # the PCA mean is this client's mean feature (all its prompts), nobody else's
        rows = torch.cat([ex.features(a.shard.train.x, prompts=p).blocks[blk] for p in prompts + [generic]])
        assert torch.allclose(torch.from_numpy(ta.pcas[blk].mean_).float(), rows.mean(0), atol=1e-4)
        assert not torch.allclose(torch.from_numpy(tb.pcas[blk].mean_).float(), rows.mean(0), atol=1e-3)
        assert ta.pcas[blk].components_.shape == tb.pcas[blk].components_.shape
        assert not torch.allclose(torch.from_numpy(ta.pcas[blk].components_), torch.from_numpy(tb.pcas[blk].components_))
    n, K = len(a.shard.train), len(names)
    assert ta.F.shape == (n, K, 16) and ta.H.shape == (n, 16) and torch.equal(ta.pos, a.shard.train.y)
    # each block's PCA output has unit RMS norm over the client's rows (F and H together)
    allrows = torch.cat([ta.F.reshape(-1, 16), ta.H])
    for blk in range(2):
        assert (allrows[:, 8 * blk:8 * (blk + 1)] ** 2).sum(1).mean().item() == pytest.approx(1.0, rel=1e-4)


def test_fit_on_other_rows_gives_every_client_one_basis(prior_dir):
    # feddifrc.pca-fit = public: the basis comes from rows no client owns and is shared by all
    a, b, pub = _ctx(prior_dir, pid=0), _ctx(prior_dir, pid=1), _ctx(prior_dir, pid=2)
    prior = fd.load_frozen_prior(str(prior_dir), "digits", "cpu")
    ex = UNetFeatureExtractor(prior, t=300, up_blocks=(0, 1), seed=5)
    names = list(a.shard.info.class_names)
    prompts, generic = fd.prompts_for("digits", names, True)
    fit_on = fd.raw_features(ex, pub.shard.train.x, prompts + [generic])
    ta = fd.diffusion_targets(ex, a.shard.train.x, a.shard.train.y, "digits", names, True, 8, fit_on=fit_on)
    tb = fd.diffusion_targets(ex, b.shard.train.x, b.shard.train.y, "digits", names, True, 8, fit_on=fit_on)
    for blk in range(2):
        assert torch.equal(torch.from_numpy(ta.pcas[blk].components_), torch.from_numpy(tb.pcas[blk].components_))
        want = torch.cat([f[blk] for f in fit_on]).mean(0)
        assert torch.allclose(torch.from_numpy(ta.pcas[blk].mean_).float(), want, atol=1e-4)
    assert parse_run_config({"method": "feddifrc", "feddifrc.pca-fit": "public"}).options.pca_fit == "public"
    with pytest.raises(ConfigError, match="feddifrc.pca-fit"):
        parse_run_config({"method": "feddifrc", "feddifrc.pca-fit": "server"})


def test_self_supervised_targets_put_the_positive_first(prior_dir):
    ctx = _ctx(prior_dir, pid=2, **{"feddifrc.labels": False})
    t = fd.compute_targets(ctx)
    assert t.F.shape[1] == len(ctx.shard.info.class_names) + 1 and (t.pos == 0).all()


def test_cached_representations_equal_freshly_computed_ones(prior_dir, monkeypatch):
    from flwr.app import RecordDict

    monkeypatch.setattr(fd, "_CACHE", {})
    state = RecordDict()
    ctx = _ctx(prior_dir, pid=1, state=state)
    first, seconds = fd.client_targets(ctx)
    assert seconds > 0 and first.nbytes == 4 * (first.F.numel() + first.H.numel()) + 8 * first.pos.numel()
    again, seconds = fd.client_targets(_ctx(prior_dir, pid=1, state=state))  # process memory
    assert seconds == 0 and again is first
    fd._CACHE.clear()  # a new ClientApp process: the node's Context.state still has them
    from_state, seconds = fd.client_targets(_ctx(prior_dir, pid=1, state=state))
    assert seconds == 0
    fresh = fd.compute_targets(_ctx(prior_dir, pid=1))
    for got in (again, from_state):
        assert torch.equal(got.F, fresh.F) and torch.equal(got.H, fresh.H) and torch.equal(got.pos, fresh.pos)
    # the table command's shared raw-feature memo gives the same numbers
    monkeypatch.setattr(fd, "SHARE_RAW_FEATURES", True)
    monkeypatch.setattr(fd, "_RAW", {})
    fd.compute_targets(_ctx(prior_dir, pid=0))  # fills the memo with another client's rows first
    shared = fd.compute_targets(_ctx(prior_dir, pid=1))
    assert torch.allclose(shared.F, fresh.F, atol=1e-5) and torch.allclose(shared.H, fresh.H, atol=1e-5)
    # a different timestep is a different cache entry
    assert fd.cache_key(_ctx(prior_dir, pid=1, **{"feddifrc.t": 100})) != fd.cache_key(ctx)


def test_regulariser_uses_the_projection_of_the_forward_pass(prior_dir):
    ctx = _ctx(prior_dir, pid=0)
    t = fd.compute_targets(ctx)
    model = build_classifier("cnn", 10, proj_dim=16)
    assert isinstance(model, ProjectedClassifier) and any(k.startswith("proj.") for k in model.state_dict())
    reg = fd.FedDifRCLoss(t, lambda_tdcl=1.0, lambda_ndcr=0.0, tau=0.04)
    idx = torch.arange(4)
    model(ctx.shard.train.x[idx])
    loss = reg(model, None, None, idx)
    z = model.project(model.embed(ctx.shard.train.x[idx]))
    assert loss.item() == pytest.approx(fd.tdcl_loss(z, t.F[idx], t.pos[idx], 0.04).item(), rel=1e-5)
    loss.backward()
    assert model.proj[0].weight.grad is not None and model.base.features[0][0].weight.grad is not None
    assert set(reg.means()) == {"tdcl", "ndcr"} and reg.means()["ndcr"] == 0.0


# ---- end to end ----------------------------------------------------------------------------------
def test_feddifrc_simulation_end_to_end(tmp_path, prior_dir):
    s = fedapp.simulate({**_flat(prior_dir), "num-server-rounds": 1, "local-epochs": 1, "out-dir": str(tmp_path),
                         "min-clients": 2}, num_clients=2, backend=ONE_ACTOR)
    assert s["status"] == "completed" and s["failures"] == []
    assert 0.0 <= s["metrics"]["accuracy"] <= 1.0
    assert set(s["metrics"]["representation_cache_bytes"]) == {"0", "1"}
    assert s["metrics"]["representation_cache_bytes_total"] > 0
