"""The FedAvg family's model weights on the wire: one flat float32 Array (WEIGHTS) in the ARRAYS_KEY record.

Flower sends every Array of a message as objects of its own (the Array and its chunks), and a SuperNode pulls
each over the Fleet API by itself: a model sent as one Array per tensor costs a deployed message two objects per
tensor. Packed, a message carries a handful of objects whatever the model's depth. The layout (each tensor's
key, shape and dtype, in state_dict order) is the model's own: both sides build the same model from the run
config, so no layout travels, and the validation gate checks one length, one dtype, finite values and the size.

Flower's aggregators work coordinate by coordinate (mean, median, trimmed mean) or on the concatenated upload
(Krum), so they combine packed uploads exactly as they combine per-tensor ones.
"""

from __future__ import annotations

from typing import Mapping

import torch
from flwr.app import Array, ArrayRecord
from torch import nn

WEIGHTS = "weights"  # the one Array in a FedAvg-family ARRAYS_KEY record
ARRAY_NAMES = (WEIGHTS,)
EXACT_INT = 2 ** 24  # float32 holds every integer of magnitude up to this exactly


def pack(state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Every tensor of `state`, flattened in its order, as one float32 vector. Integer buffers (BatchNorm's
    num_batches_tracked) ride as float32, exact below 2**24 (checked); float64 would lose precision: refused."""
    parts = []
    for key, t in state.items():
        if t.dtype in (torch.float64, torch.complex64, torch.complex128, torch.bool):
            raise ValueError(f"{key}: dtype {t.dtype} cannot ride as float32; allowed: float32, float16, bfloat16 "
                             "and integer tensors")
        if not t.is_floating_point() and t.numel() and int(t.abs().max()) >= EXACT_INT:
            raise ValueError(f"{key}: integer value {int(t.abs().max())} is not exact in float32 "
                             "(allowed: below 2**24)")
        parts.append(t.detach().reshape(-1).cpu().to(torch.float32))  # serialised: on the CPU
    if not parts:
        raise ValueError("an empty state_dict has no weights to pack")
    return torch.cat(parts)


def weights_record(state: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """The ARRAYS_KEY record of a FedAvg-family message: `pack(state)` as its one Array."""
    return ArrayRecord({WEIGHTS: Array(pack(state).numpy())})


def flat_of(record: Mapping) -> torch.Tensor:
    """The packed vector of a record (an ArrayRecord, or a kept upload's {name: tensor})."""
    if set(record.keys()) != {WEIGHTS}:
        raise ValueError(f"weights record holds {sorted(record.keys())[:5]}: expected the one array {WEIGHTS!r} "
                         "(fedapp.protocols.weights)")
    flat = record[WEIGHTS]
    return flat if isinstance(flat, torch.Tensor) else torch.from_numpy(flat.numpy())


def unpack(flat: torch.Tensor, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`flat` split into `like`'s keys, shapes and dtypes (a model's state_dict); integer buffers rounded back."""
    total = sum(t.numel() for t in like.values())
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"{WEIGHTS}: shape {tuple(flat.shape)}; the model's {len(like)} tensors need ({total},)")
    out = {}
    for (key, t), part in zip(like.items(), torch.split(flat, [t.numel() for t in like.values()])):
        part = part.reshape(t.shape)
        out[key] = part.to(t.dtype) if t.is_floating_point() else part.round().to(t.dtype)
    return out


def load_weights(model: nn.Module, record: Mapping) -> nn.Module:
    """`model` loaded (strictly) with a packed weights record; the layout is the model's own state_dict."""
    model.load_state_dict(unpack(flat_of(record), model.state_dict()), strict=True)
    return model
