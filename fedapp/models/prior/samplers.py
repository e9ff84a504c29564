"""DDIM and Z-sampling loops over a `Prior` (pipeline.py), in the manner of a diffusers scheduler module.

The loops only call the prior's noise prediction and its two one-step updates (Prior.ddim_step,
Prior.ddim_invert_step), so one set of equations serves every prior, pixel or latent.

Notation (<name in code> -> <symbol in the papers>)
  - prior.alphas_cumprod[t]         -> abar_t = prod_{s<=t} (1 - beta_s); abar at t < 0 is final_alpha_cumprod
  - z, z_t                          -> the sample at timestep t (a latent, or pixels without a VAE)
  - eps                             -> eps_theta(z_t, t, c), the predicted noise (v / x0 nets are converted)
  - x0                              -> f_theta(z_t, t), the "predicted x_0" of DDIM Eq. (12)
  - guidance, guidance1 / gamma1    -> gamma of classifier-free guidance (Ho & Salimans 2022, gamma = 1 + w)
  - guidance2 / gamma2              -> the weaker gamma of Z-sampling's inversion step
  - zigzag_t                        -> T_z: Z-sampling zigzags only on timesteps t > T_z (Espresso: 800)
  - stride                          -> num_train_timesteps // num_steps, so t_prev = t - stride

One DDIM step t -> t_prev (Song et al., DDIM, ICLR 2021), as Prior.ddim_step computes it:
  1. eps~ = eps(z_t, t, ∅) + gamma (eps(z_t, t, c) - eps(z_t, t, ∅))      guidance (Prior.predict_noise)
  2. x0 = (z_t - sqrt(1 - abar_t) eps~) / sqrt(abar_t)                    "predicted x_0", Eq. (12)
  3. x0 is clipped to [-r, r] only when the prior's scheduler config clips
  4. sigma_t = 0: eta = 0 in Eq. (16), the deterministic sampler
  5. z_{t_prev} = sqrt(abar_{t_prev}) x0 + sqrt(1 - abar_{t_prev}) eps~    Eq. (12) without its noise term

One DDIM inversion step t_prev -> t (Prior.ddim_invert_step): steps 2 and 5 with t and t_prev
swapped, eps~ evaluated at (z_{t_prev}, t_prev) (it stands in for the unknown eps at (z_t, t)), no clipping.

Z-sampling (zigzag; Bai et al. 2025, used by Espresso with T_z = 800 and gamma1 > gamma2), on every
zigzag step (below):
  1. z~_{t_prev} = DDIM(z_t; eps~(., gamma1))              denoise with strong guidance
  2. z~_t        = DDIM^-1(z~_{t_prev}; eps~(., gamma2))   invert one step with weak guidance
  3. z_{t_prev}  = DDIM(z~_t; eps~(., gamma1))             denoise again
The gap delta_gamma = gamma1 - gamma2 injects the condition's semantics into z~_t each zigzag.
Two conventions (`zigzag=`), which differ in step 2's noise prediction and in which steps zigzag:
  - "paper":    eps~ = eps~(z~_{t_prev}, t_prev, gamma2), the paper's DDIM inversion equation (the
                noise at the lower level); every step with t > T_z zigzags.
  - "official": eps~ = eps~(z~_{t_prev}, t, gamma2), as the authors' code (xie-lab-ml/Zigzag-Diffusion-
                Sampling) evaluates the UNet at the current t; it zigzags on every step but the last
                (its lambda = N - 1), here intersected with t > T_z.
Other steps are plain DDIM steps; T_z >= T turns Z-sampling into DDIM.

Timestep spacing (`spacing=`, diffusers' names): "leading" t_i = i * (T // N) + offset (the first level
is (N - 1) * (T // N) + offset: t = 900 with 10 steps), "trailing" t_i = round(T - i * T / N) - 1 (the first level is
T - 1, the top of the schedule the model was trained on, for every N; Lin et al. 2024).
`start_timestep` is the level z_T lives at: Espresso's clients fit their GMM of z^T exactly there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_GUIDANCE = 3.0  # gamma1 of every built-in tiny prior (the packaged digit-styles build reads 81.5 % at 3 and
# 86.0 % at 4; other builds peak elsewhere: docs/priors.md); SD uses ~7.5
DEFAULT_GAMMA2 = 0.0  # gamma2 of the inversion step (Z-sampling paper: unconditional inversion)
DEFAULT_ZIGZAG_T = 800  # T_z (Espresso)
SPACINGS = ("leading", "trailing")
ZIGZAG_CONVENTIONS = ("paper", "official")


@dataclass(frozen=True)
class SamplerSettings:
    """How Prior.sample turns z_T into images: the loop (`sampler`: ddim | zigzag), its `num_steps` timesteps of
    `spacing` (SPACINGS), the guidance gamma1 of every denoising step, and Z-sampling's T_z (`zigzag_t`), inversion
    guidance `gamma2` and convention (`zigzag`: ZIGZAG_CONVENTIONS), and the `precision` of its UNet calls
    (fedapp.models.precision.PRECISIONS). Espresso builds it once from its options
    (EspressoOptions.sampler_settings)."""

    sampler: str = "ddim"
    num_steps: int = 25
    guidance: float = DEFAULT_GUIDANCE
    spacing: str = "leading"
    zigzag_t: int = DEFAULT_ZIGZAG_T
    gamma2: float = DEFAULT_GAMMA2
    zigzag: str = "paper"
    precision: str = "fp32"


def leading_timesteps(num_steps: int, num_train_timesteps: int = 1000, steps_offset: int = 0) -> torch.Tensor:
    """The DDIM schedule, descending, as DDIMScheduler.set_timesteps with timestep_spacing="leading"."""
    _check_steps(num_steps, num_train_timesteps)
    ratio = num_train_timesteps // num_steps
    return torch.arange(num_steps, dtype=torch.long).flip(0) * ratio + steps_offset


def trailing_timesteps(num_steps: int, num_train_timesteps: int = 1000) -> torch.Tensor:
    """Descending, as DDIMScheduler.set_timesteps with timestep_spacing="trailing": starts at T - 1."""
    _check_steps(num_steps, num_train_timesteps)
    ratio = num_train_timesteps / num_steps
    return (torch.arange(num_train_timesteps, 0, -ratio, dtype=torch.float64).round() - 1).long()[:num_steps]


def _check_steps(num_steps: int, num_train_timesteps: int) -> None:
    if not 1 <= num_steps <= num_train_timesteps:
        raise ValueError(f"num_steps={num_steps}: must be in [1, {num_train_timesteps}]")


def schedule(num_steps: int, num_train_timesteps: int = 1000, steps_offset: int = 0,
             spacing: str = "leading") -> torch.Tensor:
    """The sampler's timesteps, descending, for a spacing in SPACINGS (trailing ignores steps_offset, as diffusers)."""
    if spacing == "leading":
        return leading_timesteps(num_steps, num_train_timesteps, steps_offset)
    if spacing == "trailing":
        return trailing_timesteps(num_steps, num_train_timesteps)
    raise ValueError(f"spacing={spacing!r}: allowed {', '.join(SPACINGS)}")


def start_timestep(prior, num_steps: int, spacing: str = "leading") -> int:
    """The level the sampler starts from (its first timestep): where z^T is drawn, so where a GMM of z^T
    must be fitted (Espresso's clients call this with the server's steps and spacing)."""
    return int(prior.timesteps(num_steps, spacing)[0])


def zigzag_steps(timesteps: torch.Tensor, zigzag_t: int, convention: str = "paper") -> torch.Tensor:
    """Which steps of `timesteps` zigzag (bool mask): t > T_z; "official" also never the last step."""
    if convention not in ZIGZAG_CONVENTIONS:
        raise ValueError(f"zigzag={convention!r}: allowed {', '.join(ZIGZAG_CONVENTIONS)}")
    mask = timesteps > zigzag_t
    if convention == "official":
        mask[-1:] = False
    return mask


def evals_per_prediction(guidance: float) -> int:
    """UNet evaluations for one guided noise prediction: gamma in {0, 1} needs one branch only."""
    return 1 if guidance in (0.0, 1.0) else 2


def expected_unet_evals(
    num_steps: int,
    zigzag_t: int | None = DEFAULT_ZIGZAG_T,
    guidance1: float = DEFAULT_GUIDANCE,
    guidance2: float = DEFAULT_GAMMA2,
    num_train_timesteps: int = 1000,
    steps_offset: int = 0,
    spacing: str = "leading",
    convention: str = "paper",
) -> int:
    """Per-sample UNet evaluations a run spends, from the schedule alone (zigzag_t=None: DDIM).

    DDIM: N * e(gamma1). Z-sampling adds e(gamma2) + e(gamma1) for each zigzag step.
    """
    per = evals_per_prediction(guidance1)
    n = num_steps * per
    if zigzag_t is not None:
        ts = schedule(num_steps, num_train_timesteps, steps_offset, spacing)
        n += int(zigzag_steps(ts, zigzag_t, convention).sum()) * (evals_per_prediction(guidance2) + per)
    return n


@torch.no_grad()
def ddim_loop(prior, z: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor | None, num_steps: int,
              guidance: float, spacing: str = "leading") -> torch.Tensor:
    """Deterministic DDIM (eta = 0) from z_T to z_0: steps 1-5 of the module docstring per timestep."""
    stride = prior.num_train_timesteps // num_steps  # t_prev = t - T // N, as DDIMScheduler.step
    for t in prior.timesteps(num_steps, spacing).tolist():
        eps = prior.predict_noise(z, t, cond, guidance, uncond)
        z = prior.ddim_step(z, eps, t, t - stride)
    return z


def inversion_timestep(t: int, t_prev: int, convention: str) -> int:
    """The UNet's timestep for Z-sampling's inversion z~_{t_prev} -> z~_t: t_prev ("paper"; the clean end
    t_prev < 0 uses 0) or t ("official")."""
    return t if convention == "official" else max(t_prev, 0)


@torch.no_grad()
def zigzag_loop(prior, z: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor | None, num_steps: int,
                guidance1: float, guidance2: float, zigzag_t: int, spacing: str = "leading",
                convention: str = "paper") -> torch.Tensor:
    """Z-sampling from z_T to z_0 (module docstring): zigzag on `zigzag_steps`, DDIM elsewhere."""
    stride = prior.num_train_timesteps // num_steps
    ts = prior.timesteps(num_steps, spacing)
    for t, zigzag in zip(ts.tolist(), zigzag_steps(ts, zigzag_t, convention).tolist()):
        t_prev = t - stride
        if zigzag:
            eps = prior.predict_noise(z, t, cond, guidance1, uncond)
            z_tilde_prev = prior.ddim_step(z, eps, t, t_prev)  # 1. z~_{t-1}, gamma1
            eps = prior.predict_noise(z_tilde_prev, inversion_timestep(t, t_prev, convention), cond, guidance2, uncond)
            z = prior.ddim_invert_step(z_tilde_prev, eps, t_prev, t)  # 2. z~_t, gamma2
        eps = prior.predict_noise(z, t, cond, guidance1, uncond)
        z = prior.ddim_step(z, eps, t, t_prev)  # 3. z_{t-1}, gamma1
    return z


@torch.no_grad()
def ddim_invert_loop(prior, z0: torch.Tensor, cond: torch.Tensor, num_steps: int, guidance: float = 1.0,
                     uncond: torch.Tensor | None = None) -> torch.Tensor:
    """DDIM inversion z_0 -> z_T over the same schedule, ascending (used by tests and methods)."""
    stride = prior.num_train_timesteps // num_steps
    z = z0
    for t in prior.timesteps(num_steps).flip(0).tolist():
        t_prev = t - stride
        eps = prior.predict_noise(z, max(t_prev, 0), cond, guidance, uncond)
        z = prior.ddim_invert_step(z, eps, t_prev, t)
    return z
