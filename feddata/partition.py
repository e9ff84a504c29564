"""Partitioners: the client pool's rows -> one row array per client.

iid, dirichlet and pathological are flwr-datasets' partitioners run on a small
`datasets.Dataset` of (label, row) pairs; domain, attribute-holdout and minority do not
exist there and are written here; dirichlet-domain is flwr-datasets' Dirichlet partitioner run on one
domain's rows (the label-skew setting of the Espresso paper: every client in the same style, labels
skewed by Dirichlet(alpha)). Every draw comes from the run seed.

Coverage of the pool: iid, dirichlet and minority (with >= 2 clients) give every pool row to
exactly one client. pathological leaves out classes no client drew (with fewer clients than
classes), domain leaves out the styles of sources it gave to other clients, and
attribute-holdout leaves out the novel pairs.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np

from .builtin import with_attribute
from .types import BaseData, config_error

_PER_CLASS = {"per-class": (int, 0)}  # cap of training images per class per client, 0 = none
# name -> its parameters (type, default); a new partitioner is a line here, a range check in _RANGES for each new
# parameter name and a branch in partition() (README "Adding a partitioner")
PARTITIONER_PARAMS: dict[str, dict[str, tuple[type, object]]] = {
    "iid": {**_PER_CLASS},
    "dirichlet": {"alpha": (float, 0.5), "min-partition-size": (int, 10), **_PER_CLASS},
    "pathological": {"classes-per-client": (int, 2), **_PER_CLASS},
    "domain": {**_PER_CLASS},
    "attribute-holdout": {"coverage": (float, 0.5), "split": (str, "iid"), **_PER_CLASS},
    "minority": {"minority-classes": (int, 2), "minority-fraction": (float, 0.1), **_PER_CLASS},
    "dirichlet-domain": {"alpha": (float, 0.5), "min-partition-size": (int, 10), "domain": (str, "photo"),
                         **_PER_CLASS},
}
PARTITIONERS: tuple[str, ...] = tuple(PARTITIONER_PARAMS)
HOLDOUT_SPLITS = ("iid", "non-iid")
_RANGES = {
    "alpha": (lambda v: v > 0, "must be > 0"),
    "min-partition-size": (lambda v: v >= 0, "must be >= 0"),
    "classes-per-client": (lambda v: v >= 1, "must be >= 1"),
    "coverage": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "split": (lambda v: v in HOLDOUT_SPLITS, f"must be one of {', '.join(HOLDOUT_SPLITS)}"),
    "minority-classes": (lambda v: v >= 1, "must be >= 1"),
    "minority-fraction": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "per-class": (lambda v: v >= 0, "must be >= 0 (0 = no cap)"),
    "domain": (lambda v: bool(v), "must name one of the dataset's domains"),  # which ones: partition() checks
}


def check_partitioner(partitioner) -> str:
    if partitioner not in PARTITIONERS:
        raise config_error("partitioner", partitioner, f"unknown; allowed: {', '.join(PARTITIONERS)}")
    return partitioner


def _coerce(key: str, value, typ: type):
    """Run-config values arrive as int/float/str; accept what means the same, refuse the rest."""
    full = f"partitioner.{key}"
    if typ is str:
        if not isinstance(value, str):
            raise config_error(full, value, "must be a string")
        return value
    if isinstance(value, bool):
        raise config_error(full, value, f"must be {'an integer' if typ is int else 'a number'}")
    if isinstance(value, str):
        try:
            value = float(value) if typ is float else int(value)
        except ValueError:
            raise config_error(full, value, f"must be {'an integer' if typ is int else 'a number'}") from None
    if typ is int:
        if isinstance(value, (int, np.integer)) or (isinstance(value, float) and value.is_integer()):
            return int(value)
        raise config_error(full, value, "must be an integer")
    if isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(value):
        return float(value)
    raise config_error(full, value, "must be a finite number")


def resolve_params(partitioner: str, params: dict | None) -> dict:
    """Defaults filled in, types coerced and ranges checked (the dataset-independent checks)."""
    spec = PARTITIONER_PARAMS[check_partitioner(partitioner)]
    out = {k: default for k, (_, default) in spec.items()}
    for key, value in (params or {}).items():
        key = key.removeprefix("partitioner.")
        if key not in spec:
            raise config_error(
                f"partitioner.{key}", value,
                f"unknown parameter for partitioner {partitioner}; allowed: {', '.join(spec)}"
            )
        coerced = _coerce(key, value, spec[key][0])
        ok, why = _RANGES[key]
        if not ok(coerced):
            raise config_error(f"partitioner.{key}", value, why)  # the value as the user wrote it
        out[key] = coerced
    return out


@dataclass
class Assignment:
    """Everything the partitioner decided, for all clients at once (cached per call signature)."""

    rows: list[np.ndarray]  # per client: rows of the base table (train + test)
    client_meta: list[dict]
    server_meta: dict = field(default_factory=dict)
    train_caps: list[dict[int, int]] = field(default_factory=list)  # per client: class -> max train images
    public_exclude: np.ndarray | None = None  # public rows the server must not get (novel pairs)


def _label_table(labels: np.ndarray, rows: np.ndarray, rng: np.random.Generator):
    """A shuffled (label, row) table: flwr partitioners cut contiguous runs, so order must be random."""
    import datasets

    perm = rng.permutation(len(rows))
    return datasets.Dataset.from_dict({"label": labels[perm].tolist(), "row": rows[perm].tolist()})


def _run_flwr(part, table, n: int) -> list[np.ndarray]:
    part.dataset = table
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # retry warnings; a final failure raises and is reported by the caller
        return [np.sort(np.asarray(part.load_partition(k)["row"], dtype=np.int64)) for k in range(n)]


def _deal(ids: np.ndarray, labels: np.ndarray, n_groups: int, rng: np.random.Generator) -> np.ndarray:
    """Group index per id, dealt round-robin within each class so groups stay class-balanced."""
    group = np.empty(len(ids), dtype=np.int64)
    start = 0
    for c in np.unique(labels):
        pos = rng.permutation(np.flatnonzero(labels == c))
        group[pos] = (start + np.arange(len(pos))) % n_groups
        start += len(pos)  # the next class continues where this one stopped: remainders spread out
    return group


def _iid(b: BaseData, pool: np.ndarray, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    from flwr_datasets.partitioner import IidPartitioner

    return _run_flwr(IidPartitioner(n), _label_table(b.y[pool], pool, rng), n)


def _uniform_caps(n: int, cap: int, k: int) -> list[dict[int, int]]:
    return [{c: cap for c in range(k)} if cap > 0 else {} for _ in range(n)]


def partition(b: BaseData, pool: np.ndarray, partitioner: str, p: dict, seed: int, n: int) -> Assignment:
    """Assign the client pool (rows of `b`) to n clients."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 7]))
    k = b.info.num_classes
    if n > len(pool):
        raise config_error("num-partitions", n, f"must be <= {len(pool)} (the client pool of {b.info.name})")
    caps = _uniform_caps(n, p["per-class"], k)
    if partitioner == "iid":
        rows = _iid(b, pool, n, rng)
        return Assignment(rows, [{} for _ in rows], train_caps=caps)
    if partitioner == "dirichlet":
        rows = _dirichlet(b, pool, p, seed, n, rng)
        return Assignment(rows, [{} for _ in rows], train_caps=caps)
    if partitioner == "dirichlet-domain":
        return _dirichlet_domain(b, pool, p, seed, n, rng, caps)
    if partitioner == "pathological":
        from flwr_datasets.partitioner import PathologicalPartitioner

        kk = p["classes-per-client"]
        if kk > k:
            raise config_error("partitioner.classes-per-client", kk, f"must be in [1, {k}] for dataset {b.info.name}")
        # first-deterministic: client i always holds class i mod K, so with n >= K every class is used
        part = PathologicalPartitioner(
            n, partition_by="label", num_classes_per_partition=kk, class_assignment_mode="first-deterministic",
            seed=seed
        )
        rows = _run_flwr(part, _label_table(b.y[pool], pool, rng), n)
        meta = [{"classes": sorted(int(c) for c in np.unique(b.y[r]))} for r in rows]
        return Assignment(rows, meta, train_caps=caps)
    if partitioner == "domain":
        return _domain(b, pool, n, rng, caps)
    if partitioner == "attribute-holdout":
        return _attribute_holdout(b, pool, p, n, rng, caps)
    if partitioner == "minority":
        return _minority(b, pool, p, n, rng, caps)
    raise AssertionError(partitioner)


def _dirichlet(b, pool, p, seed, n, rng) -> list[np.ndarray]:
    """flwr-datasets' DirichletPartitioner over the labels of `pool`: client label shares ~ Dir(alpha)."""
    from flwr_datasets.partitioner import DirichletPartitioner

    part = DirichletPartitioner(
        n, partition_by="label", alpha=p["alpha"], min_partition_size=p["min-partition-size"],
        self_balancing=False, seed=seed,
    )
    try:
        return _run_flwr(part, _label_table(b.y[pool], pool, rng), n)
    except ValueError as e:
        raise config_error(
            "partitioner.alpha", p["alpha"],
            f"could not give each of {n} clients >= {p['min-partition-size']} samples ({e}); "
            "raise alpha or lower partitioner.min-partition-size",
        ) from None


def _domain_names(b, partitioner: str) -> list[str]:
    if "domain" not in b.attrs:
        raise config_error("partitioner", partitioner,
                           f"dataset {b.info.name} has no domain attribute; "
                           f"use {' or '.join(with_attribute('domain'))}")
    return list(b.info.attributes["domain"])


def _dirichlet_domain(b, pool, p, seed, n, rng, caps) -> Assignment:
    """Label skew within one domain: the pool's rows of `partitioner.domain` split by Dirichlet(alpha).
    Each source image has one rendering per domain, so one domain's rows never share a source."""
    names = _domain_names(b, "dirichlet-domain")
    if p["domain"] not in names:
        raise config_error("partitioner.domain", p["domain"], f"allowed: {', '.join(names)} (dataset {b.info.name})")
    d = names.index(p["domain"])
    rows = _dirichlet(b, pool[b.attrs["domain"][pool] == d], p, seed, n, rng)
    meta = [{"domain": names[d], "domain_id": d} for _ in range(n)]
    return Assignment(rows, meta, server_meta={"domains": names}, train_caps=caps)


def _domain(b, pool, n, rng, caps) -> Assignment:
    """Client i gets domain i mod D. Pool sources are also dealt out so that no source image
    reaches two clients (the same digit in two styles on two clients would leak content)."""
    names = _domain_names(b, "domain")
    d = len(names)
    used = min(n, d)
    src_ids, first = np.unique(b.source[pool], return_index=True)
    src_label = b.y[pool][first]
    src_group = _deal(src_ids, src_label, used, rng)
    owner = np.empty(len(src_ids), dtype=np.int64)  # client that owns each source
    for g in range(used):
        members = np.arange(g, n, d)  # clients sharing domain g split its sources
        in_g = np.flatnonzero(src_group == g)
        owner[in_g] = members[_deal(src_ids[in_g], src_label[in_g], len(members), rng)]
    pool_owner = owner[np.searchsorted(src_ids, b.source[pool])]
    pool_dom = b.attrs["domain"][pool]
    rows = [np.sort(pool[(pool_owner == i) & (pool_dom == i % d)]) for i in range(n)]
    meta = [{"domain": names[i % d], "domain_id": i % d} for i in range(n)]
    return Assignment(rows, meta, server_meta={"domains": list(names)}, train_caps=caps)


def choose_pairs(n_y: int, n_c: int, coverage: float, rng: np.random.Generator) -> list[tuple[int, int]]:
    """round(coverage * n_y * n_c) (label, colour) pairs in which every label and colour appears."""
    total = n_y * n_c
    s = int(round(coverage * total))
    need = max(n_y, n_c)
    if s < need:
        raise config_error(
            "partitioner.coverage", coverage,
            f"must be >= {need}/{total} = {need / total:.3f} so every value of both attributes is seen",
        )
    py, pc = rng.permutation(n_y), rng.permutation(n_c)
    seen = {(int(py[i % n_y]), int(pc[i % n_c])) for i in range(need)}  # a random 'diagonal' covers all
    rest = [(a, c) for a in range(n_y) for c in range(n_c) if (a, c) not in seen]
    for j in rng.permutation(len(rest))[: s - len(seen)]:
        seen.add(rest[j])
    return sorted(seen)


def _attribute_holdout(b, pool, p, n, rng, caps) -> Assignment:
    if "color" not in b.attrs:
        raise config_error("partitioner", "attribute-holdout",
                           f"dataset {b.info.name} has no color attribute; use {' or '.join(with_attribute('color'))}")
    n_y, n_c = b.info.num_classes, len(b.info.attributes["color"])
    seen = choose_pairs(n_y, n_c, p["coverage"], rng)
    seen_set = set(seen)
    novel = [(a, c) for a in range(n_y) for c in range(n_c) if (a, c) not in seen_set]
    pair_id = b.y * n_c + b.attrs["color"]  # one int per (label, colour)
    seen_ids = np.array([a * n_c + c for a, c in seen], dtype=np.int64)
    kept = pool[np.isin(pair_id[pool], seen_ids)]  # novel-pair samples go to no client
    if p["split"] == "iid":
        rows = _iid(b, kept, n, rng)
        meta = [{"seen_pairs": [list(q) for q in seen]} for _ in range(n)]
    else:
        # pairs dealt round-robin to min(n, S) groups; clients of one group share its samples iid
        groups = min(n, len(seen))
        order = rng.permutation(len(seen))
        pair_group = {int(seen_ids[j]): i % groups for i, j in enumerate(order)}
        row_group = np.array([pair_group[int(q)] for q in pair_id[kept]], dtype=np.int64)
        rows, meta = [None] * n, [None] * n
        for g in range(groups):
            members = np.arange(g, n, groups)
            g_rows = rng.permutation(kept[row_group == g])
            g_pairs = sorted(seen[j] for i, j in enumerate(order) if i % groups == g)
            for m, chunk in zip(members, np.array_split(g_rows, len(members))):
                rows[m] = np.sort(chunk)
                meta[m] = {"seen_pairs": [list(q) for q in g_pairs]}
    server = {
        "seen_pairs": [list(q) for q in seen],
        "novel_pairs": [list(q) for q in novel],
        "coverage": len(seen) / (n_y * n_c),
        "pair_attributes": ["digit" if "digit" in b.attrs else "label", "color"],
    }
    # a prior pre-trained on public data must not have seen the held-out combinations either
    exclude = np.flatnonzero(~np.isin(pair_id, seen_ids))
    return Assignment(rows, meta, server_meta=server, train_caps=caps, public_exclude=exclude)


def _minority(b, pool, p, n, rng, caps) -> Assignment:
    """Client 0 keeps all classes, but `minority-classes` of them at `minority-fraction` of the
    mean majority count; what it gives up is dealt to the other clients."""
    k = b.info.num_classes
    m, f = p["minority-classes"], p["minority-fraction"]
    if m >= k:
        raise config_error("partitioner.minority-classes", m, f"must be in [1, {k - 1}] for dataset {b.info.name}")
    minority = sorted(int(c) for c in rng.choice(k, size=m, replace=False))
    majority = [c for c in range(k) if c not in minority]
    rows = _iid(b, pool, n, rng)
    r0 = rows[0]
    major_count = np.mean([np.sum(b.y[r0] == c) for c in majority])
    keep_n = max(1, int(round(f * major_count)))
    keep, spill = [r0[~np.isin(b.y[r0], minority)]], []
    for c in minority:
        rc = rng.permutation(r0[b.y[r0] == c])
        keep.append(rc[:keep_n])
        spill.append(rc[keep_n:])
    rows[0] = np.sort(np.concatenate(keep))
    if n > 1:  # with one client the surplus has nowhere to go and is dropped
        spill = rng.permutation(np.concatenate(spill))
        for i, chunk in enumerate(np.array_split(spill, n - 1), start=1):
            rows[i] = np.sort(np.concatenate([rows[i], chunk]))
    if p["per-class"] > 0:  # keep the imbalance under a cap too
        caps[0] = {c: (max(1, int(round(f * p["per-class"]))) if c in minority else p["per-class"]) for c in range(k)}
    facts = {"majority_classes": majority, "minority_classes": minority, "minority_fraction": f}
    meta = [dict(facts, role="minority-client" if i == 0 else "other") for i in range(n)]
    return Assignment(rows, meta, server_meta=facts, train_caps=caps)
