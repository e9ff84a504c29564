"""Espresso (and its baselines prompts / class-embed / centralized): client functions, upload
validation, the prior shipping path, and the protocol end to end.

Every prior here is a tiny random-weight network (TEST_CONFIG), never the cached trained prior."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

import fedapp
from fedapp import registry
from clients import espresso as client
from fedapp.config import ConfigError, all_defaults, parse_run_config
from fedapp.models.text import class_prompts
from fedapp.models.prior.tiny import TEST_CONFIG, random_tiny_prior
from fedapp.results import RunDir
from strategies import espresso as server
from fedapp.protocols import espresso as protocol
from fedapp.server import MeteredGrid, ServerRun
from fedapp.simulation import InProcessGrid

DATASET = "digit-styles"
FAST = {"espresso.embed-steps": 3, "espresso.steps": 3, "espresso.ratio": 1.0, "espresso.mixup-pairs": 8,
        "espresso.diffusions-per-latent": 2, "espresso.embed-batch": 8, "server-epochs": 1}


pytestmark = pytest.mark.usefixtures("inside_a_run", "one_thread")


@pytest.fixture(scope="module")
def prior():
    return random_tiny_prior(TEST_CONFIG, dataset=DATASET, seed=0)


@pytest.fixture(scope="module")
def prior_dir(prior, tmp_path_factory):
    return prior.save_pretrained(tmp_path_factory.mktemp("prior") / "tiny-random")


@pytest.fixture(scope="module")
def shard():
    from feddata import load_client_shard

    return load_client_shard(DATASET, "domain", {"per-class": 3}, 0, 0, 2)


@pytest.fixture(scope="module")
def upload(prior, shard):
    return _upload(prior, shard, _opts())


def _opts(**kw):
    return parse_run_config({"method": "espresso", **FAST, **kw}).options


def _upload(prior, shard, opts, seed=1):
    return client.espresso_upload(prior, shard.train.x, shard.train.y, num_classes=10,
                                  prompts=class_prompts(DATASET, shard.info.class_names), opts=opts, seed=seed)


def _check(prior, opts):
    return dict(opts=opts, num_classes=10, cond_shape=prior.cond_shape, latent_dim=768)


# ---- clustering -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4, 11])
def test_clustering_gives_min_J_n_clusters_that_partition_the_class(n):
    f = torch.randn(n, 6, generator=torch.Generator().manual_seed(n))
    labels = client.cluster_class(f, clusters=4)
    assert labels.shape == (n,) and set(labels.tolist()) == set(range(min(4, n)))


def test_conditions_partition_every_class_and_are_numbered_class_by_class():
    y = torch.tensor([2, 0, 2, 2, 0, 2, 2, 5])
    f = torch.randn(len(y), 4, generator=torch.Generator().manual_seed(0))
    owner, cond_class = client.assign_conditions(y, f, [0, 2, 5], clusters=4)
    assert (owner >= 0).all()  # every image has exactly one condition
    assert cond_class.tolist() == [0, 0, 2, 2, 2, 2, 5]  # min(4, n_y) per class: 2, 4, 1
    assert torch.equal(cond_class[owner], y)  # a condition only covers images of its class
    assert torch.bincount(owner).min() >= 1
    _, one = client.assign_conditions(y, None, [0, 2, 5], clusters=4)  # class mode: one per class
    assert one.tolist() == [0, 2, 5]


def test_features_are_read_only_where_a_class_splits_and_skipping_them_keeps_the_upload(prior, monkeypatch):
    """One image per class leaves min(J, 1) = 1 cluster whatever the features: the client skips their UNet pass,
    and its upload is bitwise the one computed with them read. A class of two images is split: they are read."""
    x = torch.rand(3, 3, prior.image_size, prior.image_size, generator=torch.Generator().manual_seed(0)) * 2 - 1
    kw = dict(num_classes=10, prompts=[f"digit {c}" for c in range(10)], opts=_opts(), seed=3)
    calls, real = [], client.class_features
    monkeypatch.setattr(client, "class_features", lambda *a, **k: calls.append(1) or real(*a, **k))
    skipped = client.espresso_upload(prior, x, torch.tensor([0, 4, 7]), **kw)
    assert calls == []
    with monkeypatch.context() as m:  # the path that reads them whatever the classes
        m.setattr(client, "splits_a_class", lambda counts, clusters: True)
        read = client.espresso_upload(prior, x, torch.tensor([0, 4, 7]), **kw)
    assert calls == [1] and skipped.keys() == read.keys()
    assert all(torch.equal(skipped[k], read[k]) for k in read)
    split = client.espresso_upload(prior, x, torch.tensor([0, 0, 7]), **kw)
    assert calls == [1, 1] and split[protocol.EMBEDDING_CLASS].tolist() == [0, 0, 7]  # class 0: two clusters


# ---- condition learning (Eq. 8) ------------------------------------------------------------------------
def test_learned_condition_lowers_the_diffusion_loss_of_its_cluster(prior, shard):
    x = shard.train.x[shard.train.y == 3]
    z0 = prior.encode_images(x)
    init = prior.encode_prompts([class_prompts(DATASET, shard.info.class_names)[3]])
    g = torch.Generator().manual_seed(123)  # fixed (t, eps) draws, the same for both conditions
    zz = z0.repeat(16, 1, 1, 1)
    t, eps = torch.randint(0, 1000, (len(zz),), generator=g), torch.randn(zz.shape, generator=g)

    def loss(c):
        with torch.no_grad():
            return client.diffusion_loss(prior, zz, c.expand(len(zz), -1, -1), t, eps).item()

    learned = client.learn_conditions(prior, z0, torch.zeros(len(z0), dtype=torch.long), init, steps=30,
                                      lr=0.05, batch=16, seed=0)
    assert learned.shape == init.shape and not torch.equal(learned, init)
    assert loss(learned) < loss(init) - 0.01


def test_batched_condition_learning_equals_the_per_condition_loop(prior):
    """One batched UNet call per step over every cluster == each condition optimised alone, same draws."""
    from experiments.espresso_condition_learners import learn_conditions_loop

    g = torch.Generator().manual_seed(0)
    z0 = torch.randn(9, *prior.latent_shape, generator=g)
    owner = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2, 2])  # cluster sizes 4, 1, 4: batch 2 caps two of them
    init = prior.encode_prompts(["a digit", "a photo of the digit one", "a sketch of the digit three"])
    kw = {"steps": 4, "lr": 0.05, "batch": 2, "seed": 7}
    rows0 = prior.unet_rows
    batched = client.learn_conditions(prior, z0, owner, init, **kw)
    assert prior.unet_rows - rows0 == 4 * (2 + 1 + 2)  # 4 steps, one call of min(batch, |cluster|) rows each
    looped = learn_conditions_loop(prior, z0, owner, init, **kw)
    assert batched.shape == init.shape and (batched - init).abs().max() > 0.05  # it learned
    torch.testing.assert_close(batched, looped, atol=1e-5, rtol=1e-4)
    # a condition's draws are its own: another seed changes them
    assert not torch.allclose(client.learn_conditions(prior, z0, owner, init, **{**kw, "seed": 8}), batched)


def test_condition_learning_in_chunks_keeps_the_gradient_at_a_chunks_rows(prior, monkeypatch):
    """condition-chunk: a step's rows go through the UNet a chunk at a time, and the conditions learned are
    those of the one-call step (the summed gradient is the same); the upload reads the key."""
    g = torch.Generator().manual_seed(1)
    z0 = torch.randn(9, *prior.latent_shape, generator=g)
    owner = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2, 2])
    init = prior.encode_prompts(["a digit", "a photo of the digit one", "a sketch of the digit three"])
    kw = {"steps": 4, "lr": 0.05, "batch": 3, "seed": 7}  # 3 + 1 + 3 = 7 rows a step
    whole = client.learn_conditions(prior, z0, owner, init, **kw)
    calls = []
    real_loss = prior.loss
    monkeypatch.setattr(prior, "loss", lambda z, *a, **k: calls.append(len(z)) or real_loss(z, *a, **k))
    chunked = client.learn_conditions(prior, z0, owner, init, **kw, chunk=3)
    assert calls == [3, 3, 1] * 4
    assert (whole - init).abs().max() > 0.05
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-4)
    calls.clear()
    x = torch.rand(9, 3, prior.image_size, prior.image_size) * 2 - 1
    opts = _opts(**{"espresso.conditions": "class", "espresso.init": "gaussian", "espresso.embed-steps": 2,
                    "espresso.embed-batch": 4, "espresso.condition-chunk": 2})
    client.espresso_upload(prior, x, torch.tensor([0] * 5 + [1] * 4), num_classes=10, prompts=["a digit"] * 10,
                           opts=opts, seed=0)
    assert calls == [2, 2, 2, 2] * 2  # two conditions of 4 rows a step, 2 rows a call


@pytest.mark.parametrize("spacing,first", [("trailing", 999), ("leading", 6 * (1000 // 7))])
def test_gmm_is_fitted_at_the_samplers_first_level(prior, shard, monkeypatch, spacing, first):
    """The client's GMM of z^T lives at the level the server's sampler starts from."""
    opts = _opts(**{"espresso.conditions": "prompts", "espresso.steps": 7, "espresso.spacing": spacing})
    fitted_at = []
    real_gmm = client.class_noise_gmm
    monkeypatch.setattr(client, "class_noise_gmm",
                        lambda p, z0, **kw: fitted_at.append(kw["t_T"]) or real_gmm(p, z0, **kw))
    up = _upload(prior, shard, opts)
    sampled_at = []
    real_predict = prior.predict_noise
    monkeypatch.setattr(prior, "predict_noise",
                        lambda z, t, *a, **k: sampled_at.append(int(t)) or real_predict(z, t, *a, **k))
    noise = server.sample_gmm(up["gmm_weights"][0], up["gmm_means"][0], up["gmm_variances"][0], 2, torch.Generator())
    server.denoise(prior, noise.view(2, *prior.latent_shape), prior.encode_prompts(["a digit"]).expand(2, -1, -1),
                   dataclasses.replace(opts, gamma1=3.0))
    assert set(fitted_at) == {sampled_at[0]} == {first}


def test_condition_learning_reports_its_progress_for_its_client(prior, shard, fedapp_log, monkeypatch):
    """Flower's log stream carries `client K: condition steps i/n, S s`, about every tenth of the steps."""
    from fedapp import progress

    monkeypatch.setattr(progress, "EVERY_SECONDS", float("inf"))  # the count rule only: a loaded machine adds none
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)  # 20 test-sized steps are no long phase
    z0 = prior.encode_images(shard.train.x[:4])
    init = prior.encode_prompts(["a digit"])
    with progress.client_scope(2):
        client.learn_conditions(prior, z0, torch.zeros(4, dtype=torch.long), init, steps=20, lr=0.05, batch=4, seed=0)
    lines = [r.getMessage().rsplit(",", 1)[0] for r in fedapp_log.records]
    assert lines == [f"client 2: condition steps {i}/20" for i in range(2, 21, 2)]


# ---- the GMM of z^T -------------------------------------------------------------------------------------
def test_gmm_samples_match_the_fitted_moments():
    g = torch.Generator().manual_seed(0)
    data = torch.cat([torch.randn(300, 5, generator=g) * 0.5 + 2, torch.randn(200, 5, generator=g) * 1.5 - 1])
    fit = client.fit_noise_gmm(data, components=2, seed=0)
    w, mu, var = fit["weights"].double(), fit["means"].double(), fit["variances"].double()
    assert w.shape == (2,) and mu.shape == var.shape == (2, 5) and (var > 0).all()
    mean = (w[:, None] * mu).sum(0)  # moments of sum_m w_m N(mu_m, diag(var_m))
    second = (w[:, None] * (var + mu ** 2)).sum(0)
    s = server.sample_gmm(fit["weights"], fit["means"], fit["variances"], 40000, torch.Generator().manual_seed(1))
    torch.testing.assert_close(s.double().mean(0), mean, atol=0.03, rtol=0)
    torch.testing.assert_close(s.double().var(0), second - mean ** 2, atol=0, rtol=0.04)
    # EM keeps the data's first moment
    torch.testing.assert_close(mean, data.double().mean(0), atol=1e-3, rtol=0)


def test_class_gmm_is_fitted_on_mixup_forward_diffused_latents(prior, shard):
    z0 = prior.encode_images(shard.train.x[shard.train.y == 1])
    t_T = int(prior.timesteps(25)[0])
    fit = client.class_noise_gmm(prior, z0, t_T=t_T, pairs=32, alpha=1.0, times=4, components=2, seed=0)
    assert fit["means"].shape == (2, 768)
    # z^T = sqrt(abar_T) z0_mix + sqrt(1 - abar_T) eps: the variance is close to 1 - abar_T (+ a small data term)
    abar = float(prior.alphas_cumprod[t_T])
    v = (fit["weights"][:, None] * fit["variances"]).sum(0).mean().item()
    assert abs(v - (1 - abar)) < 0.15


# ---- the upload and its validation -----------------------------------------------------------------------
def test_upload_has_only_the_protocol_keys_and_passes_validation(prior, shard, upload):
    opts, up = _opts(), upload
    assert set(up) == {"class_counts", "embeddings", "embedding_class", "cluster_sizes", "gmm_class",
                       "gmm_weights", "gmm_means", "gmm_variances"}
    assert up["class_counts"].tolist() == torch.bincount(shard.train.y, minlength=10).tolist()
    assert up["cluster_sizes"].sum() == len(shard.train)
    rd = RecordDict({protocol.UPLOAD_KEY: ArrayRecord(up)})
    assert protocol.validate_upload(rd, **_check(prior, opts)) is None
    for conditions, init, keys in [("prompts", "gaussian", {"class_counts"}),
                                   ("class", "gaussian", {"class_counts", "embeddings", "embedding_class",
                                                          "cluster_sizes"})]:
        o = _opts(**{"espresso.conditions": conditions, "espresso.init": init})
        u = _upload(prior, shard, o)
        assert set(u) == keys
        assert protocol.validate_upload(RecordDict({protocol.UPLOAD_KEY: ArrayRecord(u)}), **_check(prior, o)) is None


def _corrupt(up, key, fn):
    bad = dict(up)
    bad[key] = fn(up[key].clone())
    return RecordDict({protocol.UPLOAD_KEY: ArrayRecord(bad)})


def _set(index, value):
    def f(t):
        t[index] = value
        return t
    return f


@pytest.mark.parametrize("key, fn, why", [
    ("embeddings", _set((0, 0, 0), float("nan")), "non-finite"),
    ("gmm_means", _set((1, 0, 5), float("inf")), "non-finite"),
    ("gmm_means", lambda t: t[:, :, :100], "shape"),
    ("embeddings", lambda t: t[:, :, :5], "shape"),
    ("gmm_weights", lambda t: t[:, :2], "shape"),
    ("gmm_variances", _set((0, 0, 0), -1.0), "variances"),
    ("gmm_weights", _set((0, 0), 5.0), "weights"),
    ("cluster_sizes", _set(0, 7), "sum to"),
    ("class_counts", lambda t: t.float(), "integer"),
    ("embedding_class", _set(0, 12), "out of range"),
    ("gmm_variances", _set((0, 0, 0), 1e30), f"exceeds {protocol.GMM_MAX_VARIANCE:g}"),
    ("gmm_means", _set((0, 0, 0), -1e3), f"exceeds {protocol.GMM_MAX_ABS_MEAN:g}"),
    ("embeddings", _set((0, 0, 0), 1e4), f"a token of norm 1e+04 exceeds {protocol.EMBEDDING_MAX_NORM:g}"),
    ("gmm_means", lambda t: t.long(), "not a floating-point type"),
])
def test_validate_rejects_bad_uploads_with_a_reason(prior, upload, key, fn, why):
    opts, up = _opts(), upload
    reason = protocol.validate_upload(_corrupt(up, key, fn), **_check(prior, opts))
    assert reason is not None and why in reason
    missing = {k: v for k, v in up.items() if k != "gmm_means"}
    assert "wrong keys" in protocol.validate_upload(RecordDict({protocol.UPLOAD_KEY: ArrayRecord(missing)}),
                                                  **_check(prior, opts))
    assert "exceeds" in protocol.validate_upload(RecordDict({protocol.UPLOAD_KEY: ArrayRecord(up)}),
                                               **_check(prior, opts), max_bytes=1000)


def _reply(node, content):
    content["client"] = ConfigRecord({"partition-id": node - 1})
    r = Message(content, dst_node_id=0, message_type="train")
    r.metadata._src_node_id = node
    return r


def _strategy(tmp_path, prior, method="espresso", **kw):
    # the canned grids below answer the train phase only: the prior is not shipped (query.prior)
    cfg = parse_run_config({"method": method, "min-clients": 1, "out-dir": str(tmp_path), **FAST,
                            "espresso.ship-prior": "never", **kw})
    return registry.strategy_class(method)(ServerRun(cfg=cfg, out=RunDir(tmp_path / "run")))


class _CannedGrid:
    """Answers the train phase with prepared replies."""

    def __init__(self, replies):
        self.replies = replies

    def get_node_ids(self):
        return [1, 2, 3]

    def send_and_receive(self, messages, timeout=None):
        return self.replies


def test_strategy_drops_a_bad_upload_and_keeps_the_rest(tmp_path, prior, shard, upload):
    s = _strategy(tmp_path, prior)
    up = upload
    metrics = MetricRecord({"num-examples": len(shard.train), "client-seconds": 1.0, "num-conditions": 30})
    replies = [_reply(1, RecordDict({protocol.UPLOAD_KEY: ArrayRecord(up), "metrics": metrics})),
               _reply(2, _corrupt(up, "embeddings", _set((0, 0, 0), float("nan")))),
               _reply(3, _corrupt(up, "gmm_means", lambda t: t[:, :, :10]))]
    for r in replies[1:]:
        r.content["metrics"] = metrics
    validate = lambda c: protocol.validate_upload(c, **_check(prior, s.opts))  # noqa: E731
    s.collect_uploads(MeteredGrid(_CannedGrid(replies), s.run), [1, 2, 3], validate)
    assert sorted(s.uploads) == [0] and s.upload_bytes[0] > 0
    assert [(f["node_id"], f["phase"]) for f in s.run.failures] == [(2, "train"), (3, "train")]
    assert "non-finite" in s.run.failures[0]["reason"] and "shape" in s.run.failures[1]["reason"]
    s.prior = prior
    x, y, who, _ = s.synthesize_all(prior.encode_prompts(class_prompts(DATASET, shard.info.class_names)), 10)
    assert len(x) == len(y) == len(shard.train) and who.unique().tolist() == [0]  # ratio 1, one valid upload
    with pytest.raises(RuntimeError, match="min-clients"):  # too few valid uploads stops the run
        s2 = _strategy(tmp_path, prior, **{"min-clients": 2})
        s2.collect_uploads(MeteredGrid(_CannedGrid(replies[1:]), s2.run), [2, 3], validate)


# ---- synthesis ---------------------------------------------------------------------------------------------
def test_synthesis_batched_across_clients_makes_each_clients_own_images(tmp_path, prior, upload, shard, monkeypatch):
    """Batches of espresso.synth-batch span clients; each client's images are still those of its own plan
    (its seed): the same as synthesizing it alone, in the clients' order, and grids only for the first
    GRID_CLIENTS clients."""
    s = _strategy(tmp_path, prior, **{"espresso.synth-batch": 7})
    s.prior, s.uploads = prior, {0: upload, 3: upload, 5: upload}
    pc = prior.encode_prompts(class_prompts(DATASET, shard.info.class_names))
    monkeypatch.setattr(server, "GRID_CLIENTS", 2)
    x, y, who, _ = s.synthesize_all(pc, 10, shard.info.class_names)
    for pid in (0, 3, 5):
        seed = server.derive_seed(s.run.cfg.seed, pid)
        alone_x, alone_y, _ = server.synthesize_client(prior, upload, s.opts, pc, seed)
        assert torch.equal(y[who == pid], alone_y)
        assert (x[who == pid] - alone_x).abs().max() < 1e-3  # batch composition: float rounding, < 1/8 of a grey level
    assert who.tolist() == sorted(who.tolist()) and len(x) % 7 != 0  # a batch ended inside a client
    grids = sorted((tmp_path / "run" / "images").glob("synthetic_client*.png"))
    assert [p.name for p in grids] == ["synthetic_client0.png", "synthetic_client3.png"]
    from fedapp.images import read_row_labels

    assert all(read_row_labels(p) == shard.info.class_names for p in grids)  # each row says its class


def test_plan_synthesis_follows_ratio_cluster_sizes_and_switches(prior, shard, upload):
    opts, up = _opts(**{"espresso.ratio": 2.0}), upload
    pc = prior.encode_prompts(class_prompts(DATASET, shard.info.class_names))
    labels, noise, cond = server.plan_synthesis(up, opts, pc, prior.latent_shape, seed=5)
    assert torch.equal(torch.bincount(labels, minlength=10), 2 * up["class_counts"])
    assert noise.shape == (len(labels), 3, 16, 16) and cond.shape == (len(labels), *prior.cond_shape)
    # every picked condition is one of its class's uploaded conditions
    same = (cond[:, None] == up["embeddings"][None]).flatten(2).all(2)  # (N, E): row n is embedding e
    assert (same & (up["embedding_class"][None] == labels[:, None])).any(1).all()
    # switching init keeps the conditions (separate generators); prompts use the prompt encodings
    _, noise_g, cond_g = server.plan_synthesis(up, dataclasses.replace(opts, init="gaussian"), pc,
                                               prior.latent_shape, seed=5)
    assert torch.equal(cond_g, cond) and not torch.equal(noise_g, noise)
    _, _, cond_p = server.plan_synthesis(up, dataclasses.replace(opts, conditions="prompts"), pc,
                                         prior.latent_shape, seed=5)
    assert torch.equal(cond_p, pc[labels])


def test_baselines_pin_their_switches_for_server_and_clients(tmp_path, prior):
    p = _strategy(tmp_path, prior, method="prompts")
    assert (p.opts.conditions, p.opts.init, p.opts.sampler) == ("prompts", "gaussian", "ddim")
    rec = p.run_config_record()
    assert rec["espresso.conditions"] == "prompts" and rec["method"] == "prompts"
    assert parse_run_config(dict(rec)).options.conditions == "prompts"  # what the client parses
    c = _strategy(tmp_path, prior, method="class-embed")
    assert (c.opts.conditions, c.opts.init, c.opts.sampler) == ("class", "gaussian", "ddim")
    assert _strategy(tmp_path, prior).opts.conditions == "cluster"


def test_zigzag_needs_gamma2_below_gamma1():
    with pytest.raises(ConfigError, match="espresso.gamma2"):
        parse_run_config({"method": "espresso", "espresso.gamma1": 2.0, "espresso.gamma2": 2.0})
    assert parse_run_config({"method": "espresso", "espresso.sampler": "ddim", "espresso.gamma2": 9.0})


# ---- in-process protocol: the real client handlers behind a fake grid ----------------------------------------
class _HandlerGrid(InProcessGrid):
    """The in-process grid, nodes 1..n (partitions 0..n-1), keeping every message it sends;
    `cannot_load` nodes are on another machine (the server's prior folder is not there), `mutate`
    edits a node's reply."""

    FIRST_NODE_ID = 1

    def __init__(self, n, cannot_load=(), mutate=None):
        super().__init__(n)
        self.cannot_load, self.mutate, self.sent = set(cannot_load), mutate, []

    def deliver(self, m):
        self.sent.append(m)
        node = m.metadata.dst_node_id
        if node in self.cannot_load:
            m.content.config_records["config"]["prior"] = "/nonexistent/prior"
        reply = super().deliver(m)
        if self.mutate:
            self.mutate(node, reply)
        return reply


def test_a_node_that_lacks_a_folder_prior_is_recorded_and_the_run_goes_on(tmp_path, prior_dir, fedapp_log,
                                                                         monkeypatch):
    """A folder prior is never shipped: a node without it fails with one line, the others go on."""
    from fedapp import progress

    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)  # the client's short phases log their lines too
    cfg = {"method": "espresso", "dataset": DATASET, "partitioner.name": "domain", "partitioner.per-class": 2,
           "prior": str(prior_dir), "min-clients": 1, "out-dir": str(tmp_path), **FAST}
    s = registry.strategy_class("espresso")(
        ServerRun(cfg=parse_run_config({**all_defaults(), **cfg}), out=RunDir(tmp_path / "run")))
    grid = _HandlerGrid(2, cannot_load={2})
    metrics = s.execute(MeteredGrid(grid, s.run))
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(train) == 2 and all(protocol.PRIOR_WEIGHTS_KEY not in m.content.array_records for m in train)
    assert sorted(metrics["upload_bytes_per_client"]) == ["0"]
    [failure] = s.run.failures
    assert failure["phase"] == "train" and "this node cannot load prior='/nonexistent/prior'" in failure["reason"]
    # the client that worked reported its phases through the log, labelled by the ClientApp with its partition
    said = [r.getMessage() for r in fedapp_log.records]
    assert any(m.startswith("client 0: condition steps 3/3, ") for m in said)
    assert any(m.startswith("client 0: noise GMMs ") for m in said)
    assert not any("client 1:" in m and ": device " not in m for m in said)  # client 1 logged its device only


def test_prompts_baseline_clients_upload_class_counts_only_and_need_no_prior(tmp_path, prior_dir):

    cfg = {"method": "prompts", "dataset": DATASET, "partitioner.name": "domain", "partitioner.per-class": 2,
           "prior": str(prior_dir), "min-clients": 2, "out-dir": str(tmp_path), **FAST}
    s = registry.strategy_class("prompts")(
        ServerRun(cfg=parse_run_config({**all_defaults(), **cfg}), out=RunDir(tmp_path / "run")))
    grid = _HandlerGrid(2, cannot_load={1, 2})  # neither client has the prior: they do not need it
    metrics = s.execute(MeteredGrid(grid, s.run))
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(train) == 2 and all("prior" not in m.content.config_records for m in train)
    assert s.run.failures == [] and all(b < 300 for b in metrics["upload_bytes_per_client"].values())
    assert metrics["options"]["conditions"] == "prompts" and metrics["num_synthetic"] == 2 * 20


@pytest.mark.parametrize("model", ["cnn", "resnet18"])
def test_centralized_is_an_oracle_on_the_union_of_client_shards(tmp_path, model):
    from strategies.centralized import union_of_client_shards

    cfg = parse_run_config({**all_defaults(), "method": "centralized", "dataset": DATASET, "partitioner.name": "domain",
                            "partitioner.per-class": 4, "min-clients": 2, "server-epochs": 2, "model": model,
                            "out-dir": str(tmp_path)})
    x, y = union_of_client_shards(cfg, 2)
    assert len(x) == 2 * 40 and torch.equal(torch.bincount(y), torch.full((10,), 8))
    s = registry.strategy_class("centralized")(ServerRun(cfg=cfg, out=RunDir(tmp_path / "run")))
    grid = _HandlerGrid(2)
    metrics = s.execute(MeteredGrid(grid, s.run))
    assert metrics["oracle"] and metrics["num_train"] == 80
    assert {m.metadata.message_type for m in grid.sent} == {"evaluate"}  # clients upload nothing
    assert set(metrics["domain_accuracy"]) == {"photo", "sketch", "clipart", "quickdraw"}
    assert metrics["model"] == model and set(metrics["per_client_accuracy"]) == {"0", "1"}  # clients loaded it


# ---- end to end: Ray simulation ----------------------------------------------------------------------------
def test_espresso_end_to_end_simulation(tmp_path, prior_dir, monkeypatch):
    """The built-in prior (here a random one put where `tiny` resolves) goes to the clients as records, once
    per machine."""
    import shutil

    from fedapp.models.prior.tiny import tiny_prior_path

    monkeypatch.setenv("FEDAPP_CACHE", str(tmp_path / "cache"))  # the server's cache; the clients rebuild there
    shutil.copytree(prior_dir, tiny_prior_path(DATASET))
    s = fedapp.simulate({"method": "espresso", "dataset": DATASET, "partitioner": "domain",
                         "partitioner.per-class": 2, "prior": "tiny",
                         "min-clients": 2, "out-dir": str(tmp_path), **FAST}, num_clients=2)
    assert s["status"] == "completed" and s["failures"] == []
    m = s["metrics"]
    assert 0 <= m["accuracy"] <= 1
    assert set(m["domain_accuracy"]) == {"photo", "sketch", "clipart", "quickdraw"}
    assert m["client_domain"] == {"0": "photo", "1": "sketch"}
    assert set(m["per_client_accuracy"]) == {"0", "1"} and m["num_synthetic"] == 2 * 20
    assert all(b > 0 for b in m["upload_bytes_per_client"].values()) and m["classifier_bytes"] > 0
    assert m["options"]["conditions"] == "cluster"
    run = Path(s["run_dir"])
    from fedapp.images import read_row_labels

    assert read_row_labels(run / "images" / "synthetic_client0_photo.png")[:2] == ["zero", "one"]
    # the prior went down once, in the first wave of query.prior, and was rebuilt, content-addressed: the
    # other client's actor shares this machine's cache and answered that it holds it; train carries its digest
    by_phase = json.loads((run / "comm.json").read_text())["by_phase"]
    prior_down = sorted(p["query.prior"]["down"] for p in by_phase.values())
    assert prior_down[0] < 10_000 < 1_000_000 < prior_down[1]
    assert all(p["train"]["down"] < 50_000 for p in by_phase.values())
    assert len(list((tmp_path / "cache" / "priors").glob("shipped-*"))) == 1
    assert s["phase_seconds"]["ship-prior"] >= s["phase_seconds"]["ship-prior/query.prior"] > 0
    assert "query.prior" not in s["phase_seconds"]  # its messages: inside ship-prior, not a phase beside it
    assert sum(v for k, v in s["phase_seconds"].items() if "/" not in k) <= s["wall_seconds"]


def test_ablation_command_writes_every_row_table_and_figures(tmp_path, prior_dir):
    from experiments import espresso_ablation as ab

    # T_z = 300: the 3 DDIM steps are at t <= 666, so that the Z rows do zigzag
    sets = [f"{k}={v}" for k, v in {**FAST, "prior": str(prior_dir), "espresso.zigzag-t": 300}.items()]
    ab.main(["--seeds", "0", "1", "--clients", "2", "--per-class", "2", "--threads", "1", "--out", str(tmp_path),
             "--runs", str(tmp_path / "runs"), "--fidelity", "--reader-epochs", "1", "--fedavg-rounds", "2",
             "--set", *sets])
    out = json.loads((tmp_path / "espresso_ablation.json").read_text())
    rows = [n for n, _, _ in ab.ROWS]
    assert set(out["per_seed"]) == {"0", "1"} and list(out["summary"]) == rows
    for seed, res in out["per_seed"].items():
        # the FedAvg reference: --fedavg-rounds rounds on the clients' shards, no server-side set to read
        fedavg = res["results"].pop("FedAvg")
        rounds = [json.loads(line)["round"] for line in (tmp_path / "runs" / f"fedavg-s{seed}" / "metrics.jsonl")
                  .read_text().splitlines()]
        assert rounds[-1] == 2 and fedavg["num_train"] is None and "class_fidelity" not in fedavg
        # its verdict reads its own per-round curve: 2 rounds are too short to call it converged
        assert fedavg["verdict"] == {"converged": False, "reason": "too short", "rounds": 2}
        assert fedavg["mean_domain_accuracy"] == pytest.approx(np.mean(list(fedavg["domain_accuracy"].values())))
        for name in rows[:-1]:
            r = res["results"][name]
            assert r["mean_domain_accuracy"] == pytest.approx(np.mean(list(r["domain_accuracy"].values())))
            # ratio 1.0: each synthetic row has as many images as the clients' real data
            assert r["num_train"] == 2 * 10 * 2
            assert 0 <= r["class_fidelity"] <= 1 and 0 <= r["domain_fidelity"] <= 1
            # the ceiling's training set is the clients' real images: exactly as diverse as themselves
            assert r["diversity"] == pytest.approx(1.0) if name == "Ceiling" else r["diversity"] > 0
        assert 0 <= res["readers"]["domain_reader_test_accuracy"] <= 1
    accs = [100 * s["results"]["C"]["mean_domain_accuracy"] for s in out["per_seed"].values()]
    assert out["summary"]["C"]["avg"]["mean"] == pytest.approx(np.mean(accs))
    assert out["summary"]["C"]["avg"]["std"] == pytest.approx(np.std(accs))
    assert out["table_markdown"].count("\n") == len(rows) + 1  # header, rule, one line per row
    assert out["fedavg_reference_converged"] == {"converged": False, "reason": "too short", "seeds": 2,
                                                 "converged_seeds": 0}
    assert (tmp_path / "espresso_ablation.png").stat().st_size > 0
    assert len(list(tmp_path.glob("espresso_synthetic_*.png"))) == 2  # one grid per client domain
    assert out["fidelity_markdown"].count("\n") == len(rows)  # every row but FedAvg's
    # the sampler is server-only: the Z rows reuse their client replies (train; evaluate carries their own classifier)
    reused = {n: sec["client_calls_reused"] for n, sec in out["per_seed"]["0"]["seconds"].items()}
    assert reused["C+Z"] == reused["C+G+Z"] == 2 and reused["C"] == reused["C+G"] == reused["Ceiling"] == 0
    assert reused["FedAvg"] == 0


def test_a_stopped_ablation_seed_resumes_at_the_row_it_was_running_with_one_fixed_reader(tmp_path, prior_dir,
                                                                                        monkeypatch):
    """--resume reads the rows a stopped seed finished back from <out>/rows/ (no second run) and runs the
    rest; the table equals an uninterrupted one's. --reader-seed: every seed is read by the same readers,
    trained once; a row file of other reader settings is another file."""
    import argparse

    import fedapp.simulation as sim
    from experiments import espresso_ablation as ab
    from fedapp import readers as R

    sets = ["--set", *[f"{k}={v}" for k, v in {**FAST, "prior": str(prior_dir)}.items()]]

    def argv(out, seeds, runs_dir, *extra):
        return ["--seeds", *seeds, "--clients", "2", "--per-class", "2", "--threads", "1", "--out", str(out),
                "--runs", str(runs_dir), "--rows", "C", "C+G", "--fidelity", "--reader-epochs", "1",
                "--reader-seed", "7", *extra, *sets]

    trained, runs = [], []
    real_train, real_sim = R.train_classifier, sim.simulate_in_process
    monkeypatch.setattr(R, "train_classifier", lambda *a, **k: trained.append(k["seed"]) or real_train(*a, **k))
    real_seeds = ab.seed_results  # where the seeds start (each in its own process under --jobs)
    monkeypatch.setattr(ab, "seed_results", lambda *a, **k: trained.append("seeds") or real_seeds(*a, **k))

    def stop_at(name):
        def simulate(flat, *a, **k):
            runs.append(flat["run-name"])
            if flat["run-name"] == name:
                raise KeyboardInterrupt  # the session's end, mid-seed
            return real_sim(flat, *a, **k)
        return simulate

    monkeypatch.setattr(sim, "simulate_in_process", stop_at("c-g-s0"))
    with pytest.raises(KeyboardInterrupt):
        ab.main(argv(tmp_path / "cut", ["0"], tmp_path / "runs"))
    # one class reader, one domain reader, both trained before the seeds start (before --jobs would spawn)
    assert runs == ["c-s0", "c-g-s0"] and trained == [7, 7, "seeds"]
    monkeypatch.setattr(sim, "simulate_in_process", stop_at(None))
    runs.clear()
    # resumed elsewhere (another runs folder, as on a fresh machine): the finished rows wait in <out>/rows/
    ab.main(argv(tmp_path / "cut", ["0", "1"], tmp_path / "runs-elsewhere", "--resume"))
    assert runs == ["c-g-s0", "c-s1", "c-g-s1"] and trained == [7, 7, "seeds", "seeds"]  # no reader trained again
    cut = json.loads((tmp_path / "cut" / "espresso_ablation.json").read_text())
    assert cut["setting"]["reader_seed"] == 7
    assert cut["per_seed"]["0"]["readers"] == cut["per_seed"]["1"]["readers"]  # one instrument for every seed
    ab.main(argv(tmp_path / "whole", ["0"], tmp_path / "runs2"))
    whole = json.loads((tmp_path / "whole" / "espresso_ablation.json").read_text())
    assert cut["per_seed"]["0"]["results"] == whole["per_seed"]["0"]["results"]
    flat = ab.row_config("C", 0, argparse.Namespace(clients=2, per_class=2, runs=str(tmp_path / "runs")), {})
    args = argparse.Namespace(out=str(tmp_path / "cut"), fidelity=True, reader_epochs=1, reader_seed=7)
    for change in ({"reader_epochs": 2}, {"reader_seed": None}):
        assert ab.row_file(flat, args) != ab.row_file(flat, argparse.Namespace(**{**vars(args), **change}))
    assert ab.row_file(flat, args) == ab.row_file({**flat, "out-dir": "elsewhere"}, args)
    assert ab.row_file(flat, args) != ab.row_file({**flat, "espresso.steps": 9}, args)
    # the same spec naming another build of the prior (e.g. tiny-sd@photo with its VAE on every domain): a new row
    import fedapp.models.prior.tiny as tiny

    ceiling = ab.row_config("Ceiling", 0, argparse.Namespace(clients=2, per_class=2, runs=str(tmp_path)), {})
    before = {name: ab.row_file(f, args) for name, f in (("C", flat), ("Ceiling", ceiling))}
    assert ab.prior_build(flat) == tiny.tiny_prior_path("digit-styles").name and ab.prior_build(ceiling) is None
    real_path = tiny.tiny_prior_path
    monkeypatch.setattr(tiny, "tiny_prior_path", lambda *a, **k: real_path(*a, **k).with_name("another-build"))
    assert ab.row_file(flat, args) != before["C"] and ab.row_file(ceiling, args) == before["Ceiling"]


def test_fidelity_counts_the_intended_class_and_the_clients_own_domain():
    from experiments.espresso_ablation import fidelity

    class Reader(torch.nn.Module):  # reads the label off the first pixel
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Parameter(torch.zeros(1))  # predict() looks up the device here

        def forward(self, x):
            return torch.nn.functional.one_hot(x[:, 0, 0, 0].long(), 10).float()

    x0 = torch.zeros(4, 3, 2, 2)
    x0[:, 0, 0, 0] = torch.tensor([1.0, 1.0, 2.0, 0.0])
    x1 = torch.zeros(2, 3, 2, 2)
    x1[:, 0, 0, 0] = torch.tensor([3.0, 3.0])
    got = fidelity({"class": Reader(), "domain": Reader()},
                   [(x0, torch.tensor([1, 1, 2, 2])), (x1, torch.tensor([3, 0]))], domains=[1, 3])
    assert got["class_fidelity"] == pytest.approx(4 / 6)  # 1, 1, 2 and the first 3 are read right
    assert got["class_fidelity_by_client"] == pytest.approx([3 / 4, 1 / 2])  # per client, in the order given
    assert got["domain_fidelity"] == pytest.approx(4 / 6)  # client 0 (domain 1): two of four; client 1: both


def test_condition_diagnostic_runs_each_learner_and_refuses_a_bad_setting(prior, shard, monkeypatch):
    from experiments import espresso_conditions as ec
    from experiments.espresso_condition_learners import LEARNERS

    class Reader(torch.nn.Module):  # reads every image as class 0, domain 0 (photo: the shard's domain)
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return torch.nn.functional.one_hot(torch.zeros(len(x), dtype=torch.long), 10).float()

    cfg = parse_run_config({"method": "espresso", **FAST})
    prompts = class_prompts(DATASET, shard.info.class_names)
    uploads, real_upload = [], client.espresso_upload  # the learner each upload is handed
    monkeypatch.setattr(client, "espresso_upload",
                        lambda *a, **k: uploads.append(k["learner"]) or real_upload(*a, **k))
    for text in ("2:0.05:1", "2:0.01:4:minibatch"):
        [row] = ec.run_setting(ec.parse_setting(text), cfg, prior, [shard], prompts,
                               {"class": Reader(), "domain": Reader()},
                               ["photo", "sketch", "clipart", "quickdraw"], seed=0)
        assert row["domain_fidelity"] == 1.0 and row["class_fidelity"] == pytest.approx(1 / 10)  # 3 per class
        assert len(row["client_seconds"]) == 1 and (row["init"], row["sampler"]) == ("gaussian", "ddim")
    # each setting's learner is passed in (never patched into clients/espresso.py): batched is production's
    assert uploads == [client.learn_conditions, LEARNERS["minibatch"]] and uploads[1] is not uploads[0]
    uploads.clear()
    # --inits gaussian gmm: one upload (with its GMM), synthesised from once per init, one row each
    import strategies.espresso as server

    seen, real_synthesize = [], server.synthesize_client
    monkeypatch.setattr(server, "synthesize_client",
                        lambda prior_, up, opts, *a: seen.append((opts.init, opts.sampler, "gmm_means" in up))
                        or real_synthesize(prior_, up, opts, *a))
    rows = ec.run_setting(ec.parse_setting("2:0.05:1"), cfg, prior, [shard], prompts,
                          {"class": Reader(), "domain": Reader()}, ["photo", "sketch", "clipart", "quickdraw"],
                          seed=0, inits=("gaussian", "gmm"), sampler="zigzag")
    assert [(r["init"], r["sampler"]) for r in rows] == [("gaussian", "zigzag"), ("gmm", "zigzag")]
    assert seen == [("gaussian", "zigzag", True), ("gmm", "zigzag", True)]
    assert uploads == [client.learn_conditions]  # one upload
    few = {k: {**v, "num_steps": v["num_steps"] // 5} for k, v in ec.SAMPLERS.items() if "trailing" in k}
    rows = ec.sampler_rows(prior, prompts, {"class": Reader(), "domain": Reader()}, 20, 3.0, 0, few)
    assert all(r["class_fidelity"] == pytest.approx(0.1) and r["domains_read"] == [20, 0, 0, 0] for r in rows.values())
    with pytest.raises(ConfigError, match="--settings '200:0.05': must be steps:lr:batch"):
        ec.parse_setting("200:0.05")


def test_vae_round_trip_reads_which_styles_a_latent_prior_can_carry():
    """A VAE that returns every image in photo's style: its photo images come back as photo, the others are
    read as photo too (own domain 0); an exact VAE keeps every domain."""
    from experiments.vae_round_trip import round_trip

    names = ["photo", "sketch", "clipart", "quickdraw"]
    domain, y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    x = torch.zeros(8, 3, 2, 2)
    x[:, 0, 0, 0], x[:, 1, 0, 0] = domain / 4, y / 10  # the readers below read these two pixels

    class Reader(torch.nn.Module):
        def __init__(self, channel, scale, classes):
            super().__init__()
            self.channel, self.scale, self.classes = channel, scale, classes
            self.unused = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return torch.nn.functional.one_hot((x[:, self.channel, 0, 0] * self.scale).round().long(),
                                               self.classes).float()

    class Vae:
        def __init__(self, photo_only):
            self.photo_only = photo_only

        def encode_images(self, x):
            return x.clone()

        def decode_latents(self, z):
            if self.photo_only:
                z[:, 0] = 0.0  # every style decoded as photo's
            return z

    readers = {"class": Reader(1, 10, 10), "domain": Reader(0, 4, 4)}
    exact = round_trip(Vae(False), readers, x, y, domain, names)
    assert all(r["own_domain"] == 1.0 and r["class_accuracy"] == 1.0 and r["mse"] == 0.0 for r in exact.values())
    photo = round_trip(Vae(True), readers, x, y, domain, names)
    assert photo["photo"]["own_domain"] == 1.0 and photo["photo"]["mse"] == 0.0
    assert [photo[n]["own_domain"] for n in names[1:]] == [0.0, 0.0, 0.0]
    assert photo["quickdraw"]["domains_read"] == {"photo": 2, "sketch": 0, "clipart": 0, "quickdraw": 0}
    assert photo["sketch"]["class_accuracy"] == 1.0 and photo["sketch"]["mse"] > 0


def test_runners_filling_one_table_with_different_rows_each_add_theirs(tmp_path, monkeypatch):
    """Two runners write one --out with disjoint rows (and seeds): neither crashes on a table with no row in every
    seed, neither drops the other's rows, and a seed missing a row asked for now is run again (its finished rows
    come back from <out>/rows/), not taken as done."""
    from experiments import espresso_ablation as ab

    asked: list[list[int]] = []

    def fake_seeds(seeds, args, overrides):
        asked.append(list(seeds))
        for s in seeds:
            acc = {r: 0.5 + 0.1 * ab.ROWS.index(next(x for x in ab.ROWS if x[0] == r)) + 0.01 * s for r in args.rows}
            yield s, {"results": {r: {"domain_accuracy": {d: a for d in ("photo", "sketch", "clipart",
                                                                          "quickdraw")},
                                      "mean_domain_accuracy": a} for r, a in acc.items()},
                      "seconds": {r: {"wall": 1.0} for r in args.rows}}, {}

    monkeypatch.setattr(ab, "seed_results", fake_seeds)

    def run(rows, seeds):
        ab.main(["--seeds", *seeds, "--rows", *rows, "--threads", "1", "--out", str(tmp_path), "--resume",
                 "--runs", str(tmp_path / "runs")])
        return json.loads((tmp_path / "espresso_ablation.json").read_text())

    run(["C"], ["0"])
    table = run(["C+G"], ["1"])  # no row in both seeds: an empty summary, no figure, no crash
    assert table["summary"] == {} and sorted(table["per_seed"]) == ["0", "1"]
    table = run(["C", "C+G"], ["0", "1"])
    assert asked[-1] == [0, 1]  # each seed lacked one of the rows asked for
    assert {s: sorted(v["results"]) for s, v in table["per_seed"].items()} == {"0": ["C", "C+G"], "1": ["C", "C+G"]}
    assert sorted(table["summary"]) == ["C", "C+G"] and (tmp_path / "espresso_ablation.png").is_file()
    run(["C", "C+G"], ["0", "1"])
    assert asked[-1] == []  # every seed complete: nothing runs
