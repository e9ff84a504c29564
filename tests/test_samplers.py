"""DDIM step/inversion equations, their agreement with diffusers, and Z-sampling's evaluation count.

All models here are tiny random networks (never the cached trained prior)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from diffusers import DDIMScheduler

from fedapp.models.prior import Prior, samplers
from fedapp.models.prior.samplers import SamplerSettings, expected_unet_evals
from fedapp.models.prior.tiny import TEST_CONFIG, random_tiny_prior

PROMPT = "a photo of the digit three"
SD_SCHEDULE = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, set_alpha_to_one=False,
                   steps_offset=1, clip_sample=False)
PIXEL_SCHEDULE = dict(beta_schedule="linear", beta_start=1e-4, beta_end=0.02, set_alpha_to_one=True,
                      steps_offset=0, clip_sample=True)
# the tiny prior's: cosine betas, v-prediction (our ddim_step gets eps converted from v)
COSINE_V_SCHEDULE = dict(beta_schedule="squaredcos_cap_v2", set_alpha_to_one=True, steps_offset=0, clip_sample=True,
                         prediction_type="v_prediction")


@pytest.fixture(scope="module")
def base():
    return random_tiny_prior(TEST_CONFIG, clip_sample=False)


def with_schedule(p: Prior, **schedule) -> Prior:
    return Prior(p.tokenizer, p.text_encoder, p.unet, DDIMScheduler(num_train_timesteps=1000, **schedule))


@pytest.mark.parametrize("schedule,num_steps,spacing", [
    (SD_SCHEDULE, 10, "leading"), (PIXEL_SCHEDULE, 25, "leading"), (COSINE_V_SCHEDULE, 10, "leading"),
    (SD_SCHEDULE, 30, "trailing"), (PIXEL_SCHEDULE, 7, "trailing")],
    ids=["sd-10", "pixel-clipped-25", "cos-v-clipped-10", "sd-30-trailing", "pixel-7-trailing"])
def test_ddim_matches_diffusers_step_for_step(base, schedule, num_steps, spacing):
    p = with_schedule(base, **schedule)
    ref = DDIMScheduler(num_train_timesteps=1000, timestep_spacing=spacing, **schedule)
    ref.set_timesteps(num_steps)
    assert torch.equal(p.timesteps(num_steps, spacing), ref.timesteps)
    assert spacing == "leading" or int(ref.timesteps[0]) == 999  # trailing starts at the top: T - 1
    z = torch.randn(3, *p.latent_shape, generator=torch.Generator().manual_seed(0))
    ours, theirs = z.clone(), z.clone()
    cond = p.encode_prompts([PROMPT] * 3)
    stride = 1000 // num_steps
    null = p.null_condition(3)
    with torch.no_grad():
        for t in ref.timesteps:
            # the net's raw guided output (eps or v) from one batched call, fed to both steppers
            tt = torch.full((6,), int(t))
            raw_u, raw_c = p.unet(torch.cat([ours, ours]), tt,
                                  encoder_hidden_states=torch.cat([null, cond])).sample.chunk(2)
            raw = raw_u + 3.0 * (raw_c - raw_u)
            eps = p.predict_noise(ours, int(t), cond, guidance=3.0)  # our eps (v converted; guidance commutes)
            if schedule.get("prediction_type") != "v_prediction":
                assert torch.equal(eps, raw)
            ours = p.ddim_step(ours, eps, int(t), int(t) - stride)
            theirs = ref.step(raw, t, theirs, eta=0.0).prev_sample
            # eps-nets: the same arithmetic -> 1e-6; v-nets: x0 = (z - sqrt(1-a) eps)/sqrt(a) instead of
            # sqrt(a) z - sqrt(1-a) v divides by sqrt(abar_t): float32 rounding grows at high t (< 1e-4)
            tol = 1e-4 if schedule.get("prediction_type") == "v_prediction" else 1e-6
            assert (ours - theirs).abs().max() < tol, (int(t), (ours - theirs).abs().max().item())


@pytest.mark.parametrize("schedule", [SD_SCHEDULE, PIXEL_SCHEDULE, COSINE_V_SCHEDULE], ids=["sd", "pixel", "cos-v"])
def test_add_noise_matches_diffusers(base, schedule):
    p = with_schedule(base, **schedule)
    ref = DDIMScheduler(num_train_timesteps=1000, **schedule)
    x0, eps = torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16)
    t = torch.tensor([0, 10, 500, 999])
    assert torch.allclose(p.add_noise(x0, eps, t), ref.add_noise(x0, eps, t), atol=1e-6)


def test_inversion_step_is_exact_inverse_for_fixed_eps(base):
    # the two equations alone: DDIM^-1(DDIM(z, eps), eps) = z when both use the same eps
    z = torch.randn(2, 3, 16, 16)
    eps = torch.randn(2, 3, 16, 16)
    for t, t_prev in [(980, 960), (500, 480), (20, 0), (0, -20)]:
        back = base.ddim_invert_step(base.ddim_step(z, eps, t, t_prev), eps, t_prev, t)
        assert torch.allclose(back, z, atol=1e-4 if t > 900 else 1e-5), (t, t_prev)


def test_invert_then_denoise_returns_start_on_random_unet(base):
    """Tolerance: max |z0' - z0| < 2e-2 with 50 steps, SD schedule, guidance 1, on a tiny random UNet
    whose output layer is scaled by 0.01 (an untrained UNet's eps jumps between timesteps; a trained
    one varies slowly, which is what DDIM inversion assumes). The error also shrinks with more steps
    (measured 7.8e-3 at 50 steps)."""
    p = with_schedule(base, **SD_SCHEDULE)
    unet = p.unet
    saved = [unet.conv_out.weight.clone(), unet.conv_out.bias.clone()]
    with torch.no_grad():
        unet.conv_out.weight.mul_(0.01), unet.conv_out.bias.mul_(0.01)
    try:
        z0 = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1
        cond = p.encode_prompts([PROMPT] * 2)
        errs = {}
        for n in (20, 50):
            zT = samplers.ddim_invert_loop(p, z0, cond, n)
            out = p.sample(zT, cond, SamplerSettings(num_steps=n, guidance=1.0))
            errs[n] = (out.latents - z0).abs().max().item()
            assert out.unet_evals == n
        assert errs[50] < 2e-2
        assert errs[50] < errs[20]
    finally:
        with torch.no_grad():
            unet.conv_out.weight.copy_(saved[0]), unet.conv_out.bias.copy_(saved[1])


class GaussianDenoiser(torch.nn.Module):
    """The exact eps-predictor for data ~ N(mu, s^2 I):
    eps*(z, t) = sqrt(1-abar)(z - sqrt(abar) mu)/(abar s^2 + 1 - abar).
    Its probability-flow ODE is smooth, so DDIM inversion error is pure discretisation error."""

    def __init__(self, abar, mu=0.3, s=0.5):
        super().__init__()
        self.abar, self.mu, self.s = abar, mu, s
        self.config = SimpleNamespace(sample_size=16, in_channels=3, cross_attention_dim=32)

    def forward(self, z, t, encoder_hidden_states=None):
        a = self.abar[t].view(-1, 1, 1, 1)
        eps = (1 - a).sqrt() * (z - a.sqrt() * self.mu) / (a * self.s**2 + 1 - a)
        return SimpleNamespace(sample=eps)


def test_invert_then_denoise_on_exact_denoiser_pixel_schedule(base):
    """Pixel schedule (linear betas, abar_T ~ 4e-5) on the exact denoiser: the round-trip error is
    DDIM's first-order discretisation error, so it halves when the steps double; tolerance: max
    error < 2.5e-2 at 500 steps (measured 0.198 / 0.102 / 0.021 at 50 / 100 / 500 steps)."""
    sched = DDIMScheduler(num_train_timesteps=1000, **{**PIXEL_SCHEDULE, "clip_sample": False})
    p = Prior(base.tokenizer, base.text_encoder, GaussianDenoiser(sched.alphas_cumprod), sched)
    z0 = 0.3 + 0.5 * torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    cond = p.encode_prompts([PROMPT] * 4)
    errs = {}
    for n in (50, 100, 500):
        zT = samplers.ddim_invert_loop(p, z0, cond, n)
        assert abs(zT.std().item() - 1) < 0.1  # inverted to (near) standard noise
        errs[n] = (p.sample(zT, cond, SamplerSettings(num_steps=n, guidance=1.0)).latents - z0).abs().max().item()
    assert errs[100] < 0.6 * errs[50]
    assert errs[500] < 2.5e-2


@pytest.mark.parametrize("num_steps,zigzag_t,g1,g2", [
    (25, 800, 4.0, 0.0), (10, 500, 4.0, 2.0), (8, 300, 3.0, 1.0), (5, 0, 1.0, 0.0), (10, 1000, 4.0, 0.0)])
def test_zigzag_spends_exactly_the_scheduled_evals(base, num_steps, zigzag_t, g1, g2):
    out = base.sample(3, PROMPT, SamplerSettings(num_steps=num_steps, guidance=g1, sampler="zigzag", zigzag_t=zigzag_t,
                                                 gamma2=g2), generator=torch.Generator().manual_seed(0))
    assert out.unet_evals == expected_unet_evals(num_steps, zigzag_t, g1, g2)
    assert out.images.shape == (3, 3, 16, 16) and torch.isfinite(out.images).all()


def test_zigzag_schedule_arithmetic():
    # 25 leading steps: 960, 920, 880, 840 are > 800 -> 4 zigzags of (gamma2 pass 1 + gamma1 pass 2)
    assert expected_unet_evals(25, None, 4.0) == 50
    assert expected_unet_evals(25, 800, 4.0, 0.0) == 50 + 4 * 3
    assert expected_unet_evals(25, 800, 4.0, 2.0) == 50 + 4 * 4
    assert expected_unet_evals(25, 999, 4.0, 0.0) == 50  # T_z >= T: Z-sampling is DDIM
    # Espresso's default: 50 trailing steps 999, 979, ..., 819 > 800 -> 10 zigzags (stride 20)
    assert expected_unet_evals(50, 800, 3.0, 0.0, spacing="trailing") == 100 + 10 * 3
    assert expected_unet_evals(50, 800, 3.0, 0.0, spacing="trailing", convention="official") == 100 + 10 * 3
    assert expected_unet_evals(5, 0, 3.0, 0.0, spacing="trailing", convention="official") == 10 + 4 * 3  # not the last


def _spy(monkeypatch, prior, name):
    calls, real = [], getattr(prior, name)
    monkeypatch.setattr(prior, name, lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    return calls


@pytest.mark.parametrize("num_steps,zigzag_t,spacing",
                         [(50, 800, "trailing"), (10, 800, "leading"), (6, 0, "trailing")])
@pytest.mark.parametrize("convention", ["paper", "official"])
def test_number_of_zigzags_equals_the_steps_above_Tz(base, monkeypatch, num_steps, zigzag_t, spacing, convention):
    inversions = _spy(monkeypatch, base, "ddim_invert_step")
    base.sample(1, PROMPT, SamplerSettings(num_steps=num_steps, guidance=3.0, sampler="zigzag", zigzag_t=zigzag_t,
                                           spacing=spacing, zigzag=convention),
                generator=torch.Generator().manual_seed(0))
    above = int((base.timesteps(num_steps, spacing) > zigzag_t).sum())
    last_above = zigzag_t < int(base.timesteps(num_steps, spacing)[-1])  # only with T_z below the last step
    assert len(inversions) == above - (convention == "official" and last_above)
    assert [a[3] for a, _ in inversions] == base.timesteps(num_steps, spacing)[:len(inversions)].tolist()


@pytest.mark.parametrize("convention", ["paper", "official"])
def test_zigzag_conventions_follow_their_equations(base, convention):
    """Two trailing steps (999, 499), T_z = 600: one zigzag at t = 999, written out by hand. The inversion's
    noise is predicted at t_prev = 499 (paper) or at t = 999 (official)."""
    z = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    c = base.encode_prompts([PROMPT] * 2)
    g1, g2 = 3.0, 1.0
    settings = SamplerSettings(num_steps=2, guidance=g1, sampler="zigzag", zigzag_t=600, gamma2=g2, spacing="trailing",
                               zigzag=convention)
    out = base.sample(z, c, settings).latents
    with torch.no_grad():
        t, t_prev = 999, 499
        z_tilde_prev = base.ddim_step(z, base.predict_noise(z, t, c, g1), t, t_prev)
        tau = t_prev if convention == "paper" else t
        z_tilde = base.ddim_invert_step(z_tilde_prev, base.predict_noise(z_tilde_prev, tau, c, g2), t_prev, t)
        z1 = base.ddim_step(z_tilde, base.predict_noise(z_tilde, t, c, g1), t, t_prev)
        want = base.ddim_step(z1, base.predict_noise(z1, t_prev, c, g1), t_prev, -1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    other_convention = "official" if convention == "paper" else "paper"
    other = base.sample(z, c, dataclasses.replace(settings, zigzag=other_convention)).latents
    assert (other - out).abs().max() > 1e-3  # the conventions differ


def test_zigzag_with_tz_above_T_equals_ddim(base):
    noise = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    ddim = base.sample(noise, PROMPT, SamplerSettings(num_steps=10, guidance=3.0, sampler="ddim"))
    zz = base.sample(noise, PROMPT, SamplerSettings(num_steps=10, guidance=3.0, sampler="zigzag", zigzag_t=1000))
    assert zz.unet_evals == ddim.unet_evals == expected_unet_evals(10, None, 3.0)
    assert torch.equal(zz.latents, ddim.latents)
    zz2 = base.sample(noise, PROMPT, SamplerSettings(num_steps=10, guidance=3.0, sampler="zigzag", zigzag_t=800))
    assert zz2.unet_evals > ddim.unet_evals and not torch.equal(zz2.latents, ddim.latents)


def test_guidance_combines_branches(base):
    z = torch.randn(2, 3, 16, 16)
    c = base.encode_prompts([PROMPT, "a photo of the digit one"])
    u = base.null_condition(2)
    rows = base.unet_rows
    eps_c = base.predict_noise(z, 500, c, guidance=1.0)
    assert base.unet_rows - rows == 2  # guidance 1: one conditional pass
    eps_u = base.predict_noise(z, 500, c, guidance=0.0)
    eps_g = base.predict_noise(z, 500, c, guidance=5.0)
    assert torch.allclose(eps_u, base.predict_noise(z, 500, u, guidance=1.0), atol=1e-6)
    assert torch.allclose(eps_g, eps_u + 5.0 * (eps_c - eps_u), atol=1e-5)
