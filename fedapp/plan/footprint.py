"""What one call of a module costs in FLOPs and memory, found by running it on the meta device (shapes
only: nothing is allocated, a call at SD-1.5's size takes under a second).

`profile(module, call)` runs `call()` (a forward, on meta tensors) under torch's FlopCounterMode with a
forward hook on every leaf module, and returns:
  - flops: the counted FLOPs of the forward (matmuls, convolutions, attention; 2 per multiply-add);
  - saved_bytes: the sum of every leaf module's output: about what autograd keeps for a backward pass
    (condition learning back-propagates through the frozen UNet), an estimate, not an allocator trace;
  - peak_bytes: an inference estimate, the UNet's skip connections (the down blocks' outputs, held until
    the up blocks read them) plus the largest single layer's input and output; attention kernels that
    materialise the score matrix need more.
Weights: parameters x bytes per element (float32, the dtype runs use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Profile:
    flops: int
    saved_bytes: int
    peak_bytes: int


def _nbytes(value: Any) -> int:
    import torch

    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    if hasattr(value, "sample"):  # diffusers' output dataclasses
        return _nbytes(value.sample)
    return 0


def profile(module, call: Callable[[], Any]) -> Profile:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    saved, largest, skips = [0], [0], [0]

    def leaf(_m, inputs, output):
        out = _nbytes(output)
        saved[0] += out
        largest[0] = max(largest[0], out + _nbytes(inputs))

    def down(_m, _inputs, output):  # (hidden, res_samples): the skip connections
        skips[0] += _nbytes(output[1]) if isinstance(output, tuple) and len(output) > 1 else 0

    hooks = [m.register_forward_hook(leaf) for m in module.modules() if not list(m.children())]
    hooks += [b.register_forward_hook(down) for b in getattr(module, "down_blocks", [])]
    counter = FlopCounterMode(display=False)
    try:
        with torch.no_grad(), counter:
            call()
    finally:
        for h in hooks:
            h.remove()
    return Profile(int(counter.get_total_flops()), saved[0], skips[0] + largest[0])


def unet_call(unet, arch, rows: int, device: str = "meta") -> Callable[[], Any]:
    """One UNet2DConditionModel call at `rows` rows of the prior's latent and condition shapes."""
    import torch

    z = torch.zeros(rows, *arch.latent_shape, device=device)
    t = torch.full((rows,), 500, device=device)
    cond = torch.zeros(rows, *arch.cond_shape, device=device)
    return lambda: unet(z, t, encoder_hidden_states=cond)


def weight_bytes(module, bytes_per_element: int = 4) -> int:
    return sum(p.numel() for p in module.parameters()) * bytes_per_element


def unet_footprint(arch, infer_rows: int, train_rows: int) -> dict[str, int]:
    """The prior UNet's weights, and its activations at the largest inference call (synthesis: a CFG
    batch) and the largest call that back-propagates (condition learning), from meta-device calls."""
    from fedapp.plan.arch import meta_module

    unet = meta_module("unet", arch.unet)
    out = {"parameters": sum(p.numel() for p in unet.parameters()), "weight_bytes": weight_bytes(unet)}
    if infer_rows:
        p = profile(unet, unet_call(unet, arch, infer_rows))
        out.update(infer_rows=infer_rows, infer_activation_bytes=p.peak_bytes, infer_flops_per_call=p.flops)
    if train_rows:
        p = profile(unet, unet_call(unet, arch, train_rows))
        out.update(train_rows=train_rows, train_activation_bytes=p.saved_bytes, train_flops_per_call=3 * p.flops)
    return out
