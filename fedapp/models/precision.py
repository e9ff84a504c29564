"""The numeric precision a network's forward passes run in: float32, or bfloat16 under torch.autocast.

`auto` is bfloat16 on a CPU with native bfloat16 instructions (x86 AVX-512 BF16 or AMX), where the tiny
prior's UNet call runs ~1.8x faster (benchmarks/sampling.py), and float32 everywhere else: a CPU without
them emulates bfloat16 and gains nothing, and on a GPU the choice is left to the user.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

PRECISIONS = ("auto", "fp32", "bf16")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bfloat16 arithmetic


@functools.cache
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU lists a native bfloat16 flag (Linux on x86); False where that cannot be read."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return any(f in flags for f in BF16_CPU_FLAGS)


def resolve(precision: str, device: str | torch.device) -> str:
    """fp32 or bf16: `auto` decided for `device` (bf16 only on a CPU with native bfloat16)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: allowed {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    return "bf16" if torch.device(device).type == "cpu" and cpu_has_native_bf16() else "fp32"


def autocast(precision: str, device: str | torch.device) -> contextlib.AbstractContextManager:
    """The context forward passes run in: none for fp32 (the float32 path untouched), bfloat16 autocast for bf16."""
    device = torch.device(device)
    if resolve(precision, device) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)
