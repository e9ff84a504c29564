"""Reading and checking Flower records: what both sides of every protocol use.

`check_arrays` is the shape/dtype/finite/size check of an uploaded ArrayRecord; the protocol
modules build their upload validation on it. Nothing here raises on a malformed record: a check
returns the reason it fails, or None.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedapp.protocols import CLIENT_KEY, PARTITION_KEY, RUN_KEY


def tensors_of(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """An ArrayRecord as {key: torch tensor} (copies: the record's buffers stay untouched)."""
    return {k: torch.from_numpy(a.numpy().copy()) for k, a in record.items()}


def run_config_record(flat: Mapping[str, Any], **extra: Any) -> ConfigRecord:
    """The RUN_KEY record: the resolved flat run config, plus per-message extras (server-round)."""
    rec = ConfigRecord(dict(flat))
    for k, v in extra.items():
        rec[k] = v
    return rec


def run_config_of(content: RecordDict) -> ConfigRecord:
    return content.config_records[RUN_KEY]


def partition_of(reply: Message) -> int | None:
    """The partition id a reply claims (CLIENT_KEY), or None when absent or not an integer."""
    if not reply.has_content():
        return None
    rec = reply.content.config_records.get(CLIENT_KEY)
    value = rec.get(PARTITION_KEY) if rec is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def record_nbytes(content: RecordDict) -> int:
    """Payload bytes of a RecordDict: tensors by their buffers, config/metrics by value."""
    total = 0
    for rec in content.values():
        if isinstance(rec, ArrayRecord):
            total += sum(len(a.data) for a in rec.values())
        elif isinstance(rec, (ConfigRecord, MetricRecord)):
            for k, v in rec.items():
                total += len(k)
                vals = v if isinstance(v, list) else [v]
                for x in vals:
                    total += len(x) if isinstance(x, (bytes, str)) else 8
    return total


def check_arrays(record: ArrayRecord | None, expected: Mapping[str, tuple] | None = None,
                 max_bytes: float | None = None) -> str | None:
    """Why an uploaded ArrayRecord is unacceptable, or None if it is fine.

    `expected` maps key -> shape (None in a shape matches any size); keys must match exactly.
    Dtypes must be numeric (bool, int, uint, float) and floats finite.
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
