"""Flow matching for DCFM (torchcfm naming): path, target velocity, loss, ODE samplers, velocity net.

Linear (rectified / OT-CFM with sigma = 0) path from noise x0 ~ N(0, I) at t = 0 to data x1 at t = 1:
  x_t = t x1 + (1 - t) x0,   u_t = d x_t / dt = x1 - x0,   L_FM = E_{t, x0, x1} || v(x_t, t, y) - u_t ||^2
Samplers integrate dx/dt = v(x, t) from t = 0 to 1 and take any callable v(x, t), so DCFM's composite
velocity v^(x, y) = v(x) + sum_i w_i (v(x, y_i) - v(x)) plugs in unchanged.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from .nets import AttributeEmbedding, small_unet2d

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def sample_path(x0: torch.Tensor, x1: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = t x1 + (1 - t) x0, t of shape (B,)."""
    t = t.view(-1, *[1] * (x1.ndim - 1))
    return t * x1 + (1 - t) * x0


def target_velocity(x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
    """u_t = x1 - x0 (constant along the linear path)."""
    return x1 - x0


def fm_loss(model: Callable, x1: torch.Tensor, y: torch.Tensor | None = None, x0: torch.Tensor | None = None,
            t: torch.Tensor | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """L_FM = E || model(x_t, t, y) - (x1 - x0) ||^2 with t ~ U[0, 1], x0 ~ N(0, I) unless given."""
    if x0 is None:
        x0 = torch.randn(x1.shape, generator=generator).to(x1.device)
    if t is None:
        t = torch.rand(x1.shape[0], generator=generator).to(x1.device)
    return F.mse_loss(model(sample_path(x0, x1, t), t, y), target_velocity(x0, x1))


def _grid(steps: int, t0: float, t1: float) -> list[float]:
    return [t0 + (t1 - t0) * i / steps for i in range(steps + 1)]


@torch.no_grad()
def euler(v: Velocity, x: torch.Tensor, steps: int = 50, t0: float = 0.0, t1: float = 1.0,
          return_path: bool = False):
    """x_{k+1} = x_k + h v(x_k, t_k). return_path: also the states (steps+1, B, ...) (DCFM-B replay)."""
    path = [x]
    ts = _grid(steps, t0, t1)
    for a, b in zip(ts[:-1], ts[1:]):
        x = x + (b - a) * v(x, torch.full((x.shape[0],), a, device=x.device))
        path.append(x)
    return (x, torch.stack(path)) if return_path else x


@torch.no_grad()
def midpoint(v: Velocity, x: torch.Tensor, steps: int = 25, t0: float = 0.0, t1: float = 1.0,
             return_path: bool = False):
    """Explicit midpoint (RK2): x_{k+1} = x_k + h v(x_k + h/2 v(x_k, t_k), t_k + h/2)."""
    path = [x]
    ts = _grid(steps, t0, t1)
    for a, b in zip(ts[:-1], ts[1:]):
        h = b - a
        full = lambda s: torch.full((x.shape[0],), s, device=x.device)  # noqa: E731
        x_mid = x + 0.5 * h * v(x, full(a))
        x = x + h * v(x_mid, full(a + 0.5 * h))
        path.append(x)
    return (x, torch.stack(path)) if return_path else x


def _time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of t in [0, 1] (scaled by 1000, as diffusion timesteps)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    args = 1000.0 * t.float()[:, None] * freqs[None]
    return torch.cat([args.sin(), args.cos()], dim=1)


class VelocityNet(nn.Module):
    """v_theta(x_t, t, y) with y: (B, k) int64 attribute labels, -1 = masked/absent (null embedding).
    Two nets: ImageVelocityNet (images, DCFM's) and VectorVelocityNet (vectors, the 2-D toy)."""

    def __init__(self, attribute_sizes: list[int] | tuple[int, ...] = ()):
        super().__init__()
        self.attribute_sizes = [int(s) for s in attribute_sizes]

    def _labels(self, n: int, y: torch.Tensor | None, device) -> torch.Tensor | None:
        if not self.attribute_sizes:
            return None
        if y is None:
            return torch.full((n, len(self.attribute_sizes)), -1, dtype=torch.long, device=device)
        return y.to(device).long().view(n, -1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        t = torch.as_tensor(t, device=x.device, dtype=torch.float32).expand(x.shape[0])
        return self.velocity(x, t, self._labels(x.shape[0], y, x.device))

    def velocity(self, x: torch.Tensor, t: torch.Tensor,
                 labels: torch.Tensor | None) -> torch.Tensor:  # pragma: no cover - abstract
        """v at (x, t) of shape (B,) for labels (B, k), None without attributes."""
        raise NotImplementedError


class ImageVelocityNet(VelocityNet):
    """A diffusers UNet2DModel on (B, C, H, W); the attribute embeddings (one table per attribute, plus a
    null index) are summed into the time embedding via its class-embedding path (label_embedding="joint": one
    vector per label tuple instead, fedapp.models.nets.JointEmbedding)."""

    def __init__(self, image_size: int, attribute_sizes: list[int] | tuple[int, ...] = (), *, channels: int = 3,
                 block_out_channels: tuple[int, ...] = (32, 64, 64), attention: bool = True,
                 label_embedding: str = "sum"):
        super().__init__(attribute_sizes)
        self.unet = small_unet2d(image_size, channels, block_out_channels, attention, self.attribute_sizes or None,
                                 label_embedding=label_embedding)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        return self.unet(x, t * 1000.0, class_labels=labels).sample


class VectorVelocityNet(VelocityNet):
    """An MLP on (B, dim) vectors (the 2-D toy), the attribute embeddings added to the time features."""

    def __init__(self, dim: int, attribute_sizes: list[int] | tuple[int, ...] = (), *, hidden: int = 256,
                 layers: int = 3):
        super().__init__(attribute_sizes)
        self.time_dim = hidden
        # embed before mlp: the order of their random inits (and of the state dict) is the saved models'
        self.embed = AttributeEmbedding(self.attribute_sizes, hidden) if self.attribute_sizes else None
        mods: list[nn.Module] = [nn.Linear(dim + hidden, hidden), nn.SiLU()]
        for _ in range(layers - 1):
            mods += [nn.Linear(hidden, hidden), nn.SiLU()]
        self.mlp = nn.Sequential(*mods, nn.Linear(hidden, dim))

    def velocity(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        h = _time_embedding(t, self.time_dim)
        if labels is not None:
            h = h + self.embed(labels)
        return self.mlp(torch.cat([x, h], dim=1))
