"""A small (class-conditional) DDPM denoiser for PFDM, on diffusers' UNet2DModel and DDPMScheduler betas.

Levels follow the paper (Ho et al. 2020, PFDM): t in {0, ..., T}, abar_0 = 1,
abar_t = prod_{s<=t} (1 - beta_s) = DDPMScheduler.alphas_cumprod[t - 1]; the network is called with
diffusers' index t - 1. So x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps, and PFDM's upload at t0
is exactly `add_noise(clip(x), z, t0)`.
  loss:     E_{t ~ U(lo, hi], eps} || eps - eps_theta(x_t, t, y) ||^2
  ancestral x_{t-1} = mu~_t(x_t, x0_hat) + sigma_t z,  sigma_t^2 = beta~_t = (1-abar_{t-1})/(1-abar_t) beta_t
  DDIM      x_s = sqrt(abar_s) x0_hat + sqrt(1-abar_s) eps_hat   (eta = 0, any s < t)
PFDM splits sampling at t0: the shared model runs T -> t0 (`sample(..., t_end=t0)`), a client's private
model t0 -> 0 (`sample(..., t_start=t0, x_start=...)`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from fedapp.privacy import clip_norm

from .checkpoints import Checkpoints, OnCheckpoint, TrainState
from .nets import small_unet2d


class DDPM(nn.Module):
    """eps-prediction DDPM. num_classes=0: unconditional; labels -1 = the null class. flag=True adds a
    binary flag embedding (PFDM: 1 = clipped sample, 0 = unclipped), summed with the class embedding."""

    def __init__(self, image_size: int = 16, num_classes: int = 0, flag: bool = False, channels: int = 3,
                 block_out_channels: tuple[int, ...] = (32, 64, 64), num_train_timesteps: int = 1000,
                 beta_start: float = 1e-4, beta_end: float = 0.02, attention: bool = True):
        super().__init__()
        from diffusers import DDPMScheduler

        self.image_size, self.channels, self.num_classes, self.flag = image_size, channels, num_classes, flag
        sizes = ([num_classes] if num_classes else []) + ([2] if flag else [])
        # () builds no network: a subclass with an analytic eps (experiments/pfdm_handover.GaussianDenoiser)
        self.unet = small_unet2d(image_size, channels, block_out_channels, attention, sizes or None) \
            if block_out_channels else None
        sched = DDPMScheduler(num_train_timesteps=num_train_timesteps, beta_start=beta_start, beta_end=beta_end,
                              beta_schedule="linear")
        self.T = num_train_timesteps
        # level-indexed buffers: index t in [0, T], index 0 is the clean level
        self.register_buffer("betas", torch.cat([torch.zeros(1), sched.betas.float()]), persistent=False)
        self.register_buffer("abar", torch.cat([torch.ones(1), sched.alphas_cumprod.float()]), persistent=False)

    # ---- pieces -------------------------------------------------------------------------------------
    def _labels(self, n: int, y, flag) -> torch.Tensor | None:
        cols = []
        device = self.abar.device
        if self.num_classes:
            cols.append(torch.full((n,), -1, device=device) if y is None else torch.as_tensor(y, device=device).long())
        if self.flag:
            cols.append(torch.full((n,), -1, device=device) if flag is None
                        else torch.as_tensor(flag, device=device).long())
        return torch.stack(cols, 1) if cols else None

    def eps(self, x_t: torch.Tensor, t: torch.Tensor | int, y=None, flag=None) -> torch.Tensor:
        """eps_theta(x_t, t, y, flag) for levels t in [1, T]."""
        t = torch.as_tensor(t, device=x_t.device).long().expand(x_t.shape[0])
        return self.unet(x_t, t - 1, class_labels=self._labels(x_t.shape[0], y, flag)).sample

    def guided_eps(self, x_t: torch.Tensor, t: int, y=None, flag=None, guidance: float = 1.0) -> torch.Tensor:
        """Classifier-free guidance (Ho & Salimans 2022): eps_u + w (eps_c - eps_u), eps_u under the null class
        (-1, learnt with train_ddpm's p_uncond); w = 1 (or no labels) is the conditional eps alone. Both
        branches run as one batch."""
        if guidance == 1.0 or y is None or not self.num_classes:
            return self.eps(x_t, t, y, flag)
        y = torch.as_tensor(y, device=x_t.device).long()
        f = None if flag is None else torch.as_tensor(flag, device=x_t.device).long().repeat(2)
        both = self.eps(torch.cat([x_t, x_t]), t, torch.cat([y, torch.full_like(y, -1)]), f)
        cond, uncond = both.chunk(2)
        return uncond + guidance * (cond - uncond)

    def x0_estimate(self, x_t: torch.Tensor, eps: torch.Tensor, t: int) -> torch.Tensor:
        """x0_hat = (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t): the clean image a noise estimate implies."""
        a_t = self.abar[t]
        return (x_t - (1 - a_t).sqrt() * eps) / a_t.sqrt()

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor | int) -> torch.Tensor:
        """q(x_t | x_0): sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps."""
        a = self.abar[torch.as_tensor(t, device=x0.device)].view(-1, *[1] * (x0.ndim - 1))
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    def loss(self, x0: torch.Tensor, y=None, flag=None, t_range: tuple[int, int] = (0, 1000),
             source_t: int | None = None, generator: torch.Generator | None = None,
             reduction: str = "mean") -> torch.Tensor:
        """Epsilon MSE with t uniform in (lo, hi] (levels; PFDM's shared model: t_range=(t0, T)).
        reduction="none": one loss per sample (membership-inference scores).

        source_t: x0 is not clean but a sample at level s = source_t (PFDM's uploads, s = t0 < lo + 1).
        Then x_t = sqrt(abar_t/abar_s) x_s + sqrt(1 - abar_t/abar_s) eps' and the unbiased
        denoising-score-matching target in the eps parametrisation is
        eps' * sqrt(1 - abar_t) / sqrt(1 - abar_t/abar_s)   (E[target | x_t] = E[eps | x_t])."""
        lo, hi = t_range
        if not 0 <= lo < hi <= self.T:
            raise ValueError(f"t_range={t_range}: need 0 <= lo < hi <= {self.T}")
        if source_t is not None and source_t > lo:
            raise ValueError(f"source_t={source_t}: the sampled levels (lo, hi] must lie above it (lo >= source_t)")
        n = x0.shape[0]
        t = torch.randint(lo + 1, hi + 1, (n,), generator=generator).to(x0.device)
        noise = torch.randn(x0.shape, generator=generator).to(x0.device)
        if source_t is None:
            x_t, target = self.add_noise(x0, noise, t), noise
        else:
            r = (self.abar[t] / self.abar[source_t]).view(-1, *[1] * (x0.ndim - 1))  # abar_t / abar_s
            x_t = r.sqrt() * x0 + (1 - r).sqrt() * noise
            a_t = self.abar[t].view_as(r)
            target = noise * (1 - a_t).sqrt() / (1 - r).sqrt()
        if reduction == "none":
            return F.mse_loss(self.eps(x_t, t, y, flag), target, reduction="none").flatten(1).mean(1)
        return F.mse_loss(self.eps(x_t, t, y, flag), target)

    # ---- sampling -----------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, n: int, y=None, flag=None, t_start: int = 1000, t_end: int = 0,
               x_start: torch.Tensor | None = None, steps: int | None = None, generator: torch.Generator | None = None,
               clip_x0: bool = True, x0_bound: Callable[[torch.Tensor], torch.Tensor] | None = None,
               guidance: float = 1.0) -> torch.Tensor:
        """x_{t_end} from x_{t_start} (default N(0, I) at t_start = T). steps=None: ancestral DDPM through
        every level; steps=k: deterministic DDIM over k evenly spaced levels. clip_x0 clamps x0_hat to [-1, 1].
        x0_bound maps x0_hat into the data's known range (e.g. a norm ball); DDIM then re-derives eps from the
        bounded x0_hat (GLIDE's convention, diffusers' DDIMScheduler `use_clipped_model_output`), so that a
        wild eps prediction cannot carry its energy into x_s. guidance: classifier-free guidance scale
        (guided_eps; 1 = none)."""
        if not 0 <= t_end < t_start <= self.T:
            raise ValueError(f"t_start={t_start}, t_end={t_end}: need 0 <= t_end < t_start <= {self.T}")
        device = self.abar.device
        shape = (n, self.channels, self.image_size, self.image_size)
        x = torch.randn(shape, generator=generator).to(device) if x_start is None else x_start.to(device).clone()
        if steps is None:
            levels = list(range(t_start, t_end, -1)) + [t_end]
        else:
            levels = torch.linspace(t_start, t_end, steps + 1).round().long().unique_consecutive().tolist()
        for t, s in zip(levels[:-1], levels[1:]):
            eps = self.guided_eps(x, t, y, flag, guidance)
            a_t, a_s = self.abar[t], self.abar[s]
            x0 = self.x0_estimate(x, eps, t)
            if clip_x0:
                x0 = x0.clamp(-1, 1)
            if x0_bound is not None:
                x0 = x0_bound(x0)
                eps = (x - a_t.sqrt() * x0) / (1 - a_t).sqrt()
            if steps is not None:  # DDIM, eta = 0
                x = a_s.sqrt() * x0 + (1 - a_s).sqrt() * eps
                continue
            # ancestral: posterior q(x_{t-1} | x_t, x0) mean and variance (s = t - 1)
            beta = self.betas[t]
            mean = (a_s.sqrt() * beta / (1 - a_t)) * x0 + ((1 - beta).sqrt() * (1 - a_s) / (1 - a_t)) * x
            if s > 0:
                var = (1 - a_s) / (1 - a_t) * beta
                mean = mean + var.sqrt() * torch.randn(shape, generator=generator).to(device)
            x = mean
        return x


def build_ddpm(image_size: int, num_classes: int, flag: bool = False, channels: str | tuple = (16, 32),
               attention: bool = False) -> DDPM:
    """A DDPM from config-style sizes (`channels` "16,32" or a tuple of block widths)."""
    if isinstance(channels, str):
        channels = tuple(int(c) for c in channels.split(",") if c.strip())
    return DDPM(image_size=image_size, num_classes=num_classes, flag=flag, block_out_channels=tuple(channels),
                attention=attention)


# PFDM's shared denoiser z_w (strategies/pfdm.py trains it, clients/pfdm.py samples it): which levels it learns
SHARED_MODES = ("relative", "algorithm2")  # pfdm.shared


def shared_objective(mode: str, t0: int, T: int) -> tuple[tuple[int, int], int | None]:
    """(t_range, source_t) of z_w's DDPM.loss. relative: levels (t0, T] of the clean data, with the uploads
    taken as x_t0 (the re-scaled target); algorithm2: a standard DDPM whose data are the uploads x~,
    levels (0, T] (Algorithm 2: sampled for all T steps, its output is an x~ for the private model at t0)."""
    if mode not in SHARED_MODES:
        raise ValueError(f"pfdm.shared={mode!r}: must be one of {', '.join(SHARED_MODES)}")
    return ((t0, T), t0) if mode == "relative" else ((0, T), None)


HANDOVERS = ("auto", "ddim", "bounded", "ancestral")  # pfdm.handover: how z_w's leg T -> t0 is sampled
# auto: what passes the hand-over check in docs/results/pfdm_handover.json (colored-mnist 16 px, z_w 3,000
# steps): relative bounded (energy 1.007, DDIM's cost); algorithm2 ancestral (the only one whose energy holds)
AUTO_HANDOVER = {"relative": "bounded", "algorithm2": "ancestral"}


def handover_bound(mode: str, clip: float, abar_t0: float,
                   dims: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The range z_w's x0 estimate is known to lie in, as a projection onto an L2 ball per sample. relative:
    x0 is a clipped image, |x0| <= C. algorithm2: x0 is an upload x~ = sqrt(a) CLIP(x) + sqrt(1 - a) z (a =
    abar_t0, d pixels), |x~|^2 = a|c|^2 + (1 - a)|z|^2 + 2 sqrt(a(1 - a)) c.z: at |c| = C its mean
    a C^2 + (1 - a) d plus 6 of its standard deviations sqrt(2 d (1 - a)^2 + 4 a (1 - a) C^2) (chi-square's
    right tail: 1 in 4,000 real uploads lies beyond 4.4 of them at d = 192; a bound must not clip real data)."""
    if mode == "relative":
        radius = clip
    else:
        a = abar_t0
        radius = (a * clip ** 2 + (1 - a) * dims
                  + 6 * (2 * dims * (1 - a) ** 2 + 4 * a * (1 - a) * clip ** 2) ** 0.5) ** 0.5
    return lambda x0: clip_norm(x0, radius)


def split_steps(steps: int, t0: int, T: int = 1000) -> tuple[int, int]:
    """DDIM steps for (T -> t0, t0 -> 0) in proportion to the level ranges, at least one each."""
    k_shared = min(steps - 1, max(1, round(steps * (T - t0) / T)))
    return k_shared, max(1, steps - k_shared)


def shared_sample(shared, y: torch.Tensor, t0: int, mode: str, steps: int, generator: torch.Generator,
                  handover: str = "ddim", clip: float = 10.0) -> torch.Tensor:
    """An x_t0 from z_w (a DDPM), run from T down to the lowest level it learnt (shared_objective): t0 in
    relative mode; 0 in algorithm2 mode, whose data are the uploads x~, so its output already is at level
    t0 (and its x0 estimate is not clamped to [-1, 1], which x~ is not confined to).
    handover (pfdm.handover): auto = AUTO_HANDOVER[mode]; ddim = deterministic DDIM over `steps` levels
    with the raw eps (the earliest PFDM tables); bounded = the same with the x0 estimate projected onto
    the range the data are known to lie in (handover_bound) and eps re-derived from it; ancestral =
    bounded, sampled ancestrally through every level (`steps` unused). With an exact denoiser, strided DDIM
    loses energy where the data are near-isotropic (algorithm2's uploads: a level-0 energy ratio of 0.84
    at 20 steps, 0.99 at 200, 1.00 ancestrally; tests/test_pfdm_handover.py), at a cost of one UNet call
    per level."""
    if handover not in HANDOVERS:
        raise ValueError(f"pfdm.handover={handover!r}: must be one of {', '.join(HANDOVERS)}")
    (lowest, _), _ = shared_objective(mode, t0, shared.T)
    handover = AUTO_HANDOVER[mode] if handover == "auto" else handover
    bound = None
    if handover != "ddim":
        dims = shared.channels * shared.image_size ** 2
        bound = handover_bound(mode, clip, float(shared.abar[t0]), dims)
    return shared.sample(len(y), y, t_start=shared.T, t_end=lowest, steps=None if handover == "ancestral" else steps,
                         generator=generator, clip_x0=mode == "relative", x0_bound=bound)


def train_ddpm(model: DDPM, x: torch.Tensor, y: torch.Tensor | None = None, flag: torch.Tensor | None = None, *,
               steps: int, batch: int = 64, lr: float = 2e-3, seed: int = 0, t_range: tuple[int, int] | None = None,
               source_t: int | None = None, device: str = "cpu", p_uncond: float = 0.0,
               ema: float = 0.0, checkpoints: Iterable[int] = (),
               on_checkpoint: OnCheckpoint | None = None, state: TrainState | None = None) -> float:
    """`steps` Adam steps on minibatches drawn uniformly from (x, y, flag), all draws seeded; returns the
    mean loss of the last 10% of steps. p_uncond > 0: each label is replaced by the null class (-1) with that
    probability, so that the model also learns eps_u for classifier-free guidance (DDPM.guided_eps).
    ema > 0: the model ends with the exponential moving average of its weights over the steps, at that
    decay (torch.optim.swa_utils; DDPM's usual 0.999 to 0.9999), instead of the last step's.
    on_checkpoint(k, model, loss) after step k of `checkpoints` (fedapp.models.checkpoints), with the weights
    the run would end with there (the EMA's): a budget sweep reads one continuous run, not restarts.
    `state` (fedapp.models.checkpoints.TrainState): continue from its file where one is saved, and save it after
    each checkpoint, every `state.every` steps and the last step, so that a run cut short resumes to the weights
    an uninterrupted one ends with (a finished file: the trained weights, no step taken)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model.to(device).train()
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(ema)) if ema > 0 else None
    t_range = t_range or (0, model.T)
    tail = LossTail(steps)
    ckpt = Checkpoints(checkpoints, on_checkpoint)
    parts, extras = {"model": model, "ema": averaged, "optimizer": opt}, {"tail": tail.losses, "read": ckpt.losses}
    start = state.restore(parts, g, extras) if state is not None else 0
    for step in range(start, steps):
        idx = torch.randint(0, len(x), (min(batch, len(x)),), generator=g)
        yb = None if y is None else y[idx].to(device)
        if yb is not None and p_uncond > 0:  # drawn only then: runs without dropout keep their draws
            yb = torch.where(torch.rand(len(idx), generator=g).to(device) < p_uncond, -1, yb)
        fb = None if flag is None else flag[idx].to(device)
        loss = model.loss(x[idx].to(device), yb, fb, t_range=t_range, source_t=source_t, generator=g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if averaged is not None:
            averaged.update_parameters(model)
        tail.add(step, loss)
        ckpt.step(step + 1, loss.item(), model if averaged is None else averaged.module, model)
        if state is not None and state.due(step + 1, steps, ckpt.at):
            state.save(step + 1, parts, g, extras)
    if averaged is not None:
        model.load_state_dict(averaged.module.state_dict())
    model.eval()
    return tail.mean()


class LossTail:
    """The mean training loss over the last 10% of `steps` (at least the last step): what a trainer reports."""

    def __init__(self, steps: int):
        self.first = steps - max(1, steps // 10)
        self.losses: list[float] = []

    def add(self, step: int, loss: torch.Tensor) -> None:
        if step >= self.first:
            self.losses.append(loss.item())

    def mean(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")
