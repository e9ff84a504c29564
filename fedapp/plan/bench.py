"""A few seconds of micro-benchmark: each distinct (module, mode, rows) of a plan timed once on this machine,
with random weights (timing does not depend on them), at the run's shapes.

Calls are timed at 1, 2, 4, ... rows up to the term's rows; where a call reaches half the `budget` first,
the rest is extrapolated on the line through the last two timings. On a
CPU a module too large to time in that budget (SD-1.5's UNet: 860 M parameters, ~800 GFLOP a row; its VAE
decoder at 512 px) is timed as a stand-in with every block width divided by a power of two (the same
layers at the same spatial shapes) and scaled by the two modules' FLOP ratio from meta-device calls: an
estimate that errs high, narrow layers running less efficiently. `full=True` (and any CUDA device) times
the real module.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

MAX_REAL_PARAMS = 150_000_000  # CPU: larger modules are timed as a narrowed stand-in
MAX_REAL_FLOPS = 2e10  # CPU: a module whose one-row forward counts more is timed as a narrowed stand-in


@dataclass(frozen=True)
class Timing:
    seconds: float  # one call at the term's rows
    basis: str  # how it was found


def clock(fn: Callable[[], Any], device: str, min_time: float = 0.25, max_reps: int = 10) -> float:
    """Median seconds of fn() after a warm-up call: repeated for `min_time` seconds (at least twice, once
    for a call of half a second or more)."""
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    fn()
    sync()
    times: list[float] = []
    while not times or (len(times) < 2 and times[0] < 0.5) or (sum(times) < min_time and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def narrowed(config: dict[str, Any], factor: int) -> dict[str, Any]:
    """A diffusers UNet/VAE config with every block width divided by `factor` (groups and heads kept
    dividing them)."""
    widths = [max(1, c // factor) for c in config["block_out_channels"]]
    out = {**config, "block_out_channels": widths}
    groups = config.get("norm_num_groups", 32)
    out["norm_num_groups"] = math.gcd(groups, *widths)
    heads = config.get("attention_head_dim")  # diffusers' legacy name: heads per block (SD-2's list)
    if isinstance(heads, int):
        out["attention_head_dim"] = math.gcd(heads, *widths)
    elif isinstance(heads, (list, tuple)):
        out["attention_head_dim"] = [math.gcd(h, w) for h, w in zip(heads, widths)]
    return out


class Bench:
    def __init__(self, modules: dict[str, dict], device: str, budget: float = 1.0, full: bool = False):
        self.modules, self.device, self.budget = modules, device, budget
        self.full = full or device.startswith("cuda")
        self.cache: dict[tuple, Timing] = {}
        self.nets: dict[str, Any] = {}
        self.standins: dict[str, tuple[int, dict] | None] = {}
        self.sizes: dict[str, tuple[int, int]] = {}
        self.probes: dict[tuple[str, str], dict[int, float]] = {}  # (module, mode) -> {rows: seconds}

    def seconds(self, module: str, mode: str, rows: int) -> Timing:
        key = (module, mode, rows)
        if key not in self.cache:
            self.cache[key] = self._measure(module, mode, rows)
        return self.cache[key]

    def _net(self, name: str, spec: dict[str, Any]):
        from fedapp.plan.modules import build

        if name not in self.nets:
            self.nets[name] = build(spec, self.device)
        return self.nets[name]

    def _timed(self, name: str, spec: dict[str, Any], mode: str, rows: int) -> tuple[float, str]:
        """(seconds of one call at `rows`, how): calls timed at 1, 2, 4, ... rows (kept for the module and
        mode) until `rows` or until a call takes half the budget; beyond, extrapolated on the line through
        the last two (a call's fixed cost plus a cost per row)."""
        from fedapp.plan.modules import gmm_fit, step

        if spec["kind"] == "gmm":
            return clock(gmm_fit(spec, rows), self.device), "measured"
        net = self._net(name, spec)
        probes = self.probes.setdefault((name, mode), {})
        r = 1
        while True:
            if r not in probes:
                probes[r] = clock(step(spec, net, mode, r, self.device), self.device, min_time=0.1)
            if r == rows or probes[r] >= self.budget / 2:
                break
            r = min(rows, 2 * r)
        if r == rows:
            return probes[r], "measured"
        if r == 1:
            return probes[1] * rows, f"timed at 1 row, x{rows}"
        half = max(k for k in probes if k < r)
        per_row = max(probes[r] - probes[half], 0.0) / (r - half)
        return probes[r] + per_row * (rows - r), f"timed at {half} and {r} rows, extrapolated"

    def _measure(self, module: str, mode: str, rows: int) -> Timing:
        spec = self.modules[module]
        if spec["kind"].startswith("prior.") and not self.full:
            if module not in self.standins:
                self.standins[module] = self._standin(spec)
            standin = self.standins[module]
            if standin is not None:
                return self._via_standin(module, spec, standin, mode, rows)
        return Timing(*self._timed(module, spec, mode, rows))

    def _standin(self, spec: dict[str, Any]) -> tuple[int, dict] | None:
        """(factor, spec) of a narrowed copy when the real prior module is too large to time here; else None."""
        part = spec["kind"].split(".")[1]
        arch = spec["arch"]
        factor = 1
        while True:
            config = getattr(arch, part) if factor == 1 else narrowed(getattr(arch, part), factor)
            params, flops = self._size(spec, dataclasses.replace(arch, **{part: config}))
            if params <= MAX_REAL_PARAMS and flops <= MAX_REAL_FLOPS:
                return None if factor == 1 else (factor, {**spec, "arch": dataclasses.replace(arch, **{part: config})})
            if factor >= 64:
                return factor, {**spec, "arch": dataclasses.replace(arch, **{part: config})}
            factor *= 2

    def _size(self, spec: dict[str, Any], arch) -> tuple[int, int]:
        """(parameters, forward FLOPs of one row) of the prior module of `spec` with `arch`, on the meta device."""
        import json

        from fedapp.plan.footprint import profile
        from fedapp.plan.modules import build, forward, inputs

        key = json.dumps([spec["kind"], dataclasses.asdict(arch)], sort_keys=True, default=str)
        if key not in self.sizes:
            s = {**spec, "arch": arch}
            net = build(s, "meta")
            a = inputs(s, 1, "meta")
            self.sizes[key] = sum(p.numel() for p in net.parameters()), profile(net, lambda: forward(s, net, a)).flops
        return self.sizes[key]

    def _via_standin(self, module: str, spec: dict, standin: tuple[int, dict], mode: str, rows: int) -> Timing:
        factor, small = standin
        seconds, how = self._timed(f"{module}/{factor}", small, mode, rows)
        ratio = self._size(spec, spec["arch"])[1] / max(1, self._size(small, small["arch"])[1])
        return Timing(seconds * ratio, f"stand-in with widths/{factor} ({how}) x{ratio:.3g} FLOPs")
