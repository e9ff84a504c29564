"""Reading and checking Flower records: what both sides of every protocol use.

`check_arrays` is the shape/dtype/finite/size check of an uploaded ArrayRecord; the protocol
modules build their upload validation on it. Nothing here raises on a malformed record: a check
returns the reason it fails, or None.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedapp.protocols import CLIENT_KEY, PARTITION_KEY


def tensors_of(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """An ArrayRecord as {key: torch tensor} (copies: the record's buffers stay untouched)."""
    return {k: torch.from_numpy(a.numpy().copy()) for k, a in record.items()}


def run_config_record(flat: Mapping[str, Any], **extra: Any) -> ConfigRecord:
    """The RUN_KEY record: the resolved flat run config, plus per-message extras (server-round)."""
    rec = ConfigRecord(dict(flat))
    for k, v in extra.items():
        rec[k] = v
    return rec


def partition_of(reply: Message) -> int | None:
    """The partition id a reply claims (CLIENT_KEY), or None when absent or not an integer."""
    if not reply.has_content():
        return None
    return partition_in(reply.content)


def claimed_partition(content: RecordDict) -> object:
    """The raw partition-id value of CLIENT_KEY (any type; None when absent): for the claim check."""
    rec = content.config_records.get(CLIENT_KEY)
    return rec.get(PARTITION_KEY) if rec is not None else None


def partition_in(content: RecordDict) -> int | None:
    """The partition id a reply's content claims, or None when absent or not an integer."""
    value = claimed_partition(content)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def record_nbytes(content: RecordDict) -> int:
    """Payload bytes of a RecordDict: Flower's own count_bytes() for array and metric records (buffers or
    64-bit values, plus keys); config records by config_nbytes."""
    return sum(config_nbytes(rec) if isinstance(rec, ConfigRecord) else rec.count_bytes() for rec in content.values())


def config_nbytes(rec: ConfigRecord) -> int:
    """ConfigRecord.count_bytes()'s rule (keys; str/bytes by length, bool 1, int/float 8, lists element-wise),
    counted here because Flower 1.42's own raises ValueError on an empty string value, which ours carry."""
    def one(v) -> int:
        return len(v) if isinstance(v, (str, bytes)) else 1 if isinstance(v, bool) else 8

    return sum(len(k) + sum(one(x) for x in (v if isinstance(v, list) else [v])) for k, v in rec.items())


def dtypes_of(record: ArrayRecord) -> dict[str, str]:
    """key -> numpy dtype name of a record (the global model's: what an upload must match)."""
    return {k: str(np.dtype(a.dtype)) for k, a in record.items()}


def check_arrays(record: ArrayRecord | None, expected: Mapping[str, tuple] | None = None,
                 max_bytes: float | None = None, dtypes: Mapping[str, str] | None = None) -> str | None:
    """Why an uploaded ArrayRecord is unacceptable, or None if it is fine.

    `expected` maps key -> shape (None in a shape matches any size); keys must match exactly.
    Dtypes must be numeric (bool, int, uint, float) and floats finite; with `dtypes` (key -> numpy
    dtype name, e.g. the global model's: `dtypes_of`) exactly that dtype, so an integer upload is
    never averaged into a float model.
    """
    if not isinstance(record, ArrayRecord):
        return "no arrays in the upload"
    if expected is not None and set(record.keys()) != set(expected):
        missing = sorted(set(expected) - set(record.keys()))[:3]
        extra = sorted(set(record.keys()) - set(expected))[:3]
        return f"wrong keys (missing {missing}, unexpected {extra})"
    size = 0
    for key, arr in record.items():
        try:
            a = arr.numpy()
        except Exception as err:  # malformed bytes: the upload is bad, the run goes on
            return f"{key}: unreadable array ({type(err).__name__})"
        size += a.nbytes
        if expected is not None:
            shape = expected[key]
            if len(shape) != a.ndim or any(s is not None and s != d for s, d in zip(shape, a.shape)):
                return f"{key}: shape {tuple(a.shape)} != expected {tuple(shape)}"
        if a.dtype.kind not in "fiub":
            return f"{key}: dtype {a.dtype} is not numeric"
        if dtypes is not None and key in dtypes and a.dtype != np.dtype(dtypes[key]):
            return f"{key}: dtype {a.dtype} != expected {dtypes[key]}"
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            return f"{key}: non-finite values"
    if max_bytes is not None and size > max_bytes:
        return f"upload of {size} bytes exceeds the cap of {int(max_bytes)} bytes"
    return None


def check_integer(arrays: Mapping[str, torch.Tensor], *keys: str) -> str | None:
    """Counts and indices must be integer tensors."""
    for k in keys:
        if k in arrays and (arrays[k].is_floating_point() or arrays[k].is_complex() or arrays[k].dtype == torch.bool):
            return f"{k}: dtype {arrays[k].dtype} is not an integer type"
    return None


def check_float(arrays: Mapping[str, torch.Tensor], *keys: str) -> str | None:
    """Embeddings, means and variances must be floating-point tensors."""
    for k in keys:
        if k in arrays and not arrays[k].is_floating_point():
            return f"{k}: dtype {arrays[k].dtype} is not a floating-point type"
    return None


def check_at_most(what: str, counts: np.ndarray, limit: np.ndarray) -> str | None:
    """Counts a client reports against what the server knows its shard holds (same shape)."""
    counts, limit = np.asarray(counts), np.asarray(limit)
    if counts.shape != limit.shape:
        return f"{what}: shape {counts.shape} != the shard's {limit.shape}"
    over = np.argwhere(counts > limit)
    if len(over):
        i = tuple(int(v) for v in over[0])
        idx = i[0] if len(i) == 1 else i
        return f"{what}[{idx}]={counts[i]} exceeds the {limit[i]} the client's shard holds"
    return None
