"""PFDM's local-DP release (Theorem 5.1): clip, then forward-diffuse to level t0.

  CLIP(x, C)  = x · min(1, C / ||x||_2)                                  (per sample)
  x~          = sqrt(abar_t0) · CLIP(x, C) + sqrt(1 - abar_t0) · z,  z ~ N(0, I)
Dividing by sqrt(abar_t0) shows x~ is the Gaussian mechanism on CLIP(x) (L2 sensitivity 2C) with
  sigma^2     = (1 - abar_t0) / abar_t0
  epsilon     <= 2C^2 / sigma^2 + C · sqrt(8 log(1/delta) / sigma^2)      (LDP bound, per data point)
Levels follow fedapp.models.ddpm: abar_0 = 1, abar_t = prod_{s<=t} (1 - beta_s), linear betas
1e-4 .. 0.02 over T = 1000 (DDPM / PFDM). Computed in float64 so the epsilon figures are exact.

The noise z of a release comes from the operating system (`os_generator`), never from the run seed:
the server knows the seed and the config, and noise it could regenerate would protect nothing.

epsilon by three accountants (`pfdm.accountant`), all for the same single Gaussian release with
noise multiplier z = sigma / (2C): `bound` is the paper's closed form above (loose, what the paper
reports), `rdp` and `pld` are tight numerical accountants from Google's dp-accounting (Renyi DP and
privacy-loss distributions). At t0 = 693, C = 10, delta = 1e-5: bound 9.996, rdp 9.187, pld 8.552.
"""

from __future__ import annotations

import functools
import math
import secrets

import numpy as np
import torch

T = 1000
BETA_START, BETA_END = 1e-4, 0.02


def linear_abar(T: int = T, beta_start: float = BETA_START, beta_end: float = BETA_END) -> np.ndarray:
    """abar_t for t = 0..T (index 0 = the clean level), float64."""
    betas = np.linspace(beta_start, beta_end, T, dtype=np.float64)
    return np.concatenate([[1.0], np.cumprod(1.0 - betas)])


def ldp_sigma2(t0: int, **schedule) -> float:
    """sigma^2 = (1 - abar_t0) / abar_t0: the Gaussian mechanism's variance after rescaling by 1/sqrt(abar_t0)."""
    a = linear_abar(**schedule)[t0]
    return float((1.0 - a) / a)


def ldp_epsilon(t0: int, clip: float, delta: float, **schedule) -> float:
    """Theorem 5.1: epsilon(t0, C, delta) = 2C^2/sigma^2 + C sqrt(8 log(1/delta)/sigma^2); inf at t0 = 0."""
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta}: must be in (0, 1)")
    if t0 <= 0:
        return math.inf  # no noise, no privacy
    s2 = ldp_sigma2(t0, **schedule)
    return 2 * clip**2 / s2 + clip * math.sqrt(8 * math.log(1 / delta) / s2)


ACCOUNTANTS = ("bound", "rdp", "pld")


def accountant_epsilon(t0: int, clip: float, delta: float, accountant: str = "bound", **schedule) -> float:
    """epsilon of one release at level t0 by `accountant` (module docstring); inf at t0 = 0."""
    if accountant == "bound":
        return ldp_epsilon(t0, clip, delta, **schedule)
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"pfdm.accountant={accountant!r}: must be one of {', '.join(ACCOUNTANTS)}")
    if t0 <= 0:
        return math.inf
    from dp_accounting import dp_event
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    # the Gaussian mechanism on CLIP(x) with L2 sensitivity 2C (replace-one, per data point)
    multiplier = math.sqrt(ldp_sigma2(t0, **schedule)) / (2 * clip)
    # PLD's grid spans the privacy loss in steps of the discretisation: its default (1e-4) needs a 301 GiB
    # array at t0 = 1 (epsilon ~ 2e6); a step of a millionth of the closed-form bound keeps ~6 digits
    interval = max(1e-4, 1e-6 * ldp_epsilon(t0, clip, delta, **schedule))
    acc = RdpAccountant() if accountant == "rdp" else PLDAccountant(value_discretization_interval=interval)
    acc.compose(dp_event.GaussianDpEvent(multiplier))
    return float(acc.get_epsilon(delta))


def smallest_t0(target_epsilon: float, clip: float, delta: float, accountant: str = "bound", **schedule) -> int:
    """The smallest t0 whose epsilon is <= target_epsilon (epsilon falls as t0 grows: the least noise
    that meets the budget keeps the most signal). Bisection: every accountant is monotone in t0."""
    n = len(linear_abar(**schedule)) - 1

    def ok(t0: int) -> bool:
        return accountant_epsilon(t0, clip, delta, accountant, **schedule) <= target_epsilon

    if not ok(n):
        raise ValueError(f"pfdm.epsilon={target_epsilon}: unreachable with clip={clip}, delta={delta} "
                         f"(epsilon at t0=T is {accountant_epsilon(n, clip, delta, accountant, **schedule):.4g})")
    lo, hi = 1, n  # ok(hi) holds
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def clip_norm(x: torch.Tensor, clip: float) -> torch.Tensor:
    """CLIP(x, C) = x · min(1, C / ||x||_2), per sample (norm over all but the first dim)."""
    norms = x.flatten(1).norm(dim=1).clamp_min(1e-12)
    return x * (clip / norms).clamp(max=1.0).view(-1, *[1] * (x.ndim - 1))


def forward_diffuse(x: torch.Tensor, t0: int, noise: torch.Tensor) -> torch.Tensor:
    """x~ = sqrt(abar_t0) x + sqrt(1 - abar_t0) z."""
    a = float(linear_abar()[t0])
    return math.sqrt(a) * x + math.sqrt(1.0 - a) * noise


def os_generator() -> np.random.Generator:
    """A generator seeded with 256 bits from the OS (secrets): nothing in the run config determines it."""
    return np.random.default_rng(np.random.SeedSequence(secrets.randbits(256)))


def os_torch_generator() -> torch.Generator:
    """A torch generator seeded with 63 bits from the OS: for DP-SGD's Poisson sampling and noise (dpdm)."""
    return torch.Generator().manual_seed(secrets.randbits(63))


# ---- DP-SGD (the dpdm baseline): Opacus' RDP accountant ---------------------------------------------
@functools.cache  # built once; a function so that importing this module does not import Opacus
def rdp_orders() -> tuple[float, ...]:
    """Opacus' default RDP orders (1.1 .. 63) extended down to 1.01 and up to 1024: with few steps or much noise
    the best order lies above 63, with little noise (epsilon ~100) below 1.1, where Opacus warns "Optimal order
    is the largest / smallest alpha" and reports a looser epsilon than the accountant can prove."""
    from opacus.accountants import RDPAccountant

    return tuple([1.01, 1.02, 1.03, 1.05, 1.07] + RDPAccountant.DEFAULT_ALPHAS
                 + [64, 80, 96, 128, 160, 192, 256, 384, 512, 768, 1024])  # integers above 63: exact in Opacus


def dpsgd_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """epsilon after `steps` DP-SGD steps with Poisson sampling at `sample_rate` and Gaussian noise of
    std noise_multiplier x the clipping norm (Opacus' RDPAccountant); 0 steps spend nothing."""
    from opacus.accountants import RDPAccountant

    if steps <= 0:
        return 0.0
    acc = RDPAccountant()
    acc.history = [(noise_multiplier, sample_rate, steps)]
    return float(acc.get_epsilon(delta, alphas=rdp_orders()))


@functools.lru_cache(maxsize=64)  # a bisection of ~30 accountant calls (~10 s); a client asks every round
def dpsgd_noise_multiplier(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The smallest noise multiplier whose DP-SGD run of `steps` steps spends at most epsilon (Opacus)."""
    import warnings

    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        # Opacus brackets sigma from 10 upwards before bisecting; at those probe points (never the answer) the best
        # order of a few-step run lies beyond any range and it warns. The answer's epsilon is dpsgd_epsilon's.
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha", category=UserWarning)
        return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate,
                                          steps=steps, accountant="rdp", alphas=rdp_orders()))


def privatize(x: torch.Tensor, clip: float, t0: int, generator: torch.Generator | np.random.Generator | None = None
              ) -> torch.Tensor:
    """The PFDM upload: forward_diffuse(CLIP(x, C), t0, z) with fresh z per sample. A client's release
    passes no generator (z from the OS); the server's own evaluation may pass a seeded torch one."""
    if isinstance(generator, torch.Generator):
        noise = torch.randn(x.shape, generator=generator, dtype=torch.float32)
    else:
        noise = torch.from_numpy((generator or os_generator()).standard_normal(x.shape, dtype=np.float32))
    return forward_diffuse(clip_norm(x.float(), clip), t0, noise).float()


def privacy_record(t0: int, clip: float, delta: float, accountant: str = "bound") -> dict:
    """What summary.json reports under `privacy`: epsilon by the chosen accountant, and by all three."""
    by = {name: accountant_epsilon(t0, clip, delta, name) for name in ACCOUNTANTS}
    return {"mechanism": "PFDM upload: clip + forward diffusion to t0 (local DP, Theorem 5.1)",
            "epsilon": by[accountant], "accountant": accountant, "epsilon_by_accountant": by,
            "delta": delta, "t0": int(t0), "clip": clip,
            "sigma2": ldp_sigma2(t0), "abar_t0": float(linear_abar()[t0]),
            "noise_source": "operating system (secrets), not the run seed",
            "released_in_the_clear": ["labels"]}


def resolve_t0(t0: int, epsilon: float, clip: float, delta: float, accountant: str = "bound") -> int:
    """pfdm.t0 when set (> 0), else the smallest t0 meeting pfdm.epsilon by `accountant`."""
    return int(t0) if t0 > 0 else smallest_t0(epsilon, clip, delta, accountant)
