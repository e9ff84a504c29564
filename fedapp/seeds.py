"""One seed derivation for every random draw a run makes (except DP noise, which comes from the OS)."""

from __future__ import annotations

import zlib
from typing import Any


def derive_seed(*parts: Any) -> int:
    """A 31-bit seed from the run seed and salts (partition id, round, phase), stable across
    processes and machines (crc32, not Python's randomised hash)."""
    return zlib.crc32(",".join(str(p) for p in parts).encode()) & 0x7FFFFFFF
