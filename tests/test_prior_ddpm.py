"""The small DDPM for PFDM: levels, loss, training signal, sampling over sub-ranges."""

import pytest
import torch

from fedapp.models.ddpm import DDPM


def toy(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    x = torch.full((n, 3, 8, 8), -0.8)
    x[y == 1] = 0.8  # class 0 dark, class 1 bright
    return x + 0.05 * torch.randn(x.shape, generator=g), y


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DDPM(image_size=8, num_classes=2, flag=True, block_out_channels=(16, 32), attention=False)


def test_levels_follow_the_paper(model):
    # abar_0 = 1 and abar_t = prod_{s<=t} (1 - beta_s), linear betas 1e-4 .. 0.02
    assert model.abar[0] == 1 and torch.isclose(model.abar[1], torch.tensor(1 - 1e-4))
    assert torch.allclose(model.abar[1:], torch.cumprod(1 - model.betas[1:], 0))
    x0, z = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    a = model.abar[690]
    assert torch.allclose(model.add_noise(x0, z, 690), a.sqrt() * x0 + (1 - a).sqrt() * z)
    # the x0 estimate inverts add_noise given the true noise, at every level
    for t in (1, 300, 690, 1000):
        assert torch.allclose(model.x0_estimate(model.add_noise(x0, z, t), z, t), x0, atol=1e-3)


def test_loss_finite_and_decreases(model):
    x, y = toy()
    flag = torch.arange(len(x)) % 2
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(20):
        loss = model.loss(x, y, flag, generator=g)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5
    # PFDM's shared model: levels (t0, T] only, from uploads at level t0
    x_t0 = model.add_noise(x, torch.randn_like(x), 690)
    assert torch.isfinite(model.loss(x_t0, y, t_range=(690, 1000), source_t=690))
    with pytest.raises(ValueError):
        model.loss(x, y, t_range=(600, 1000), source_t=690)


def test_source_t_target_is_unbiased_for_eps():
    # E[target | x_t] = E[eps_total | x_t]: check the linear-Gaussian identity on 1-D data x0 = 0
    m = DDPM(image_size=8, block_out_channels=(16, 32), attention=False)
    s, t = 600, 800
    r = m.abar[t] / m.abar[s]
    n = 200_000
    g = torch.Generator().manual_seed(0)
    z, e = torch.randn(n, generator=g), torch.randn(n, generator=g)
    x_s = (1 - m.abar[s]).sqrt() * z  # x0 = 0
    x_t = r.sqrt() * x_s + (1 - r).sqrt() * e
    target = e * (1 - m.abar[t]).sqrt() / (1 - r).sqrt()
    eps_total = x_t / (1 - m.abar[t]).sqrt()  # the true eps given x0 = 0
    # regress both on x_t: equal slopes
    slope = lambda v: (v * x_t).mean() / (x_t * x_t).mean()  # noqa: E731
    assert abs(slope(target) - slope(eps_total)) < 0.02


def test_sampling_sub_ranges(model):
    g = torch.Generator().manual_seed(0)
    y = torch.tensor([0, 1, -1])
    mid = model.sample(3, y, flag=torch.tensor([1, 1, 1]), t_start=1000, t_end=690, steps=5, generator=g)
    assert mid.shape == (3, 3, 8, 8) and torch.isfinite(mid).all()
    out = model.sample(3, y, flag=torch.tensor([0, 0, 0]), t_start=690, t_end=0, x_start=mid, steps=5, generator=g)
    assert out.shape == (3, 3, 8, 8) and out.abs().max() <= 1 + 1e-5
    anc = model.sample(2, torch.tensor([0, 1]), t_start=20, t_end=0, generator=g)  # ancestral, every level
    assert torch.isfinite(anc).all()
    unc = DDPM(image_size=8, block_out_channels=(16, 32), attention=False)
    assert unc.sample(2, steps=3, generator=g).shape == (2, 3, 8, 8)


@pytest.mark.parametrize("clip_x0", [True, False])
def test_ancestral_sampler_is_diffusers_ddpm_scheduler_step_for_step(clip_x0):
    """DDPM.sample (steps=None) against diffusers' DDPMScheduler.step with the same eps network and the
    same generator: level t is diffusers' timestep t - 1, the posterior variance beta~ ("fixed_small"),
    x0_hat clipped to [-1, 1] or not; both draw the start and each step's noise in the same order."""
    from diffusers import DDPMScheduler

    torch.manual_seed(0)
    m = DDPM(image_size=8, num_classes=2, block_out_channels=(16, 32), attention=False, num_train_timesteps=30).eval()
    y = torch.tensor([0, 1])
    ours = m.sample(2, y, t_start=30, generator=torch.Generator().manual_seed(5), clip_x0=clip_x0)
    sched = DDPMScheduler(num_train_timesteps=30, beta_start=1e-4, beta_end=0.02, beta_schedule="linear",
                          clip_sample=clip_x0, clip_sample_range=1.0, variance_type="fixed_small")
    sched.set_timesteps(30)
    g = torch.Generator().manual_seed(5)
    x = torch.randn((2, 3, 8, 8), generator=g)
    with torch.no_grad():
        for t in sched.timesteps:
            x = sched.step(m.eps(x, int(t) + 1, y), t, x, generator=g).prev_sample
    # diffusers recomputes beta_t as 1 - abar_t / abar_{t-1} in float32, which loses ~1e-3 of a beta of 1e-4
    # to cancellation; DDPM uses the betas themselves: 2e-4 / 5e-4 apart after 30 steps (values up to 2.7)
    assert torch.allclose(ours, x, rtol=1e-3, atol=1e-3), (ours - x).abs().max()


def test_label_dropout_feeds_the_null_class_at_its_rate_and_only_when_asked(monkeypatch):
    from fedapp.models.ddpm import train_ddpm

    torch.manual_seed(0)
    m = DDPM(image_size=8, num_classes=3, block_out_channels=(8, 16), attention=False)
    seen = []
    real_loss = DDPM.loss
    monkeypatch.setattr(DDPM, "loss", lambda self, x0, y=None, *a, **k: seen.append(y.clone()) or
                        real_loss(self, x0, y, *a, **k))
    x, y = torch.randn(40, 3, 8, 8), torch.arange(40) % 3
    train_ddpm(m, x, y, steps=30, batch=20, p_uncond=0.3)
    labels = torch.cat(seen)
    assert abs(float((labels == -1).double().mean()) - 0.3) < 0.08  # 600 draws: 0.3 +- 0.019 (1 sd)
    assert set(labels[labels >= 0].tolist()) == {0, 1, 2}
    seen.clear()
    train_ddpm(m, x, y, steps=10, batch=20)
    assert (torch.cat(seen) >= 0).all()


@pytest.mark.parametrize("ema", [0.0, 0.9])
def test_checkpoints_read_one_continuous_run_with_the_weights_it_would_end_with(ema):
    from fedapp.models.ddpm import train_ddpm

    x, y = torch.randn(24, 3, 8, 8), torch.arange(24) % 3

    def fresh():
        torch.manual_seed(0)
        return DDPM(image_size=8, num_classes=3, block_out_channels=(8, 16), attention=False)

    plain = fresh()
    train_ddpm(plain, x, y, steps=6, batch=8, ema=ema)
    read, probe = {}, torch.randn(2, 3, 8, 8)
    swept = fresh()

    def at(step, m, loss):
        assert not m.training and loss > 0
        read[step] = m.eps(probe, 500, torch.tensor([0, 1])).detach()

    last_loss = train_ddpm(swept, x, y, steps=6, batch=8, ema=ema, checkpoints=[3, 6], on_checkpoint=at)
    assert sorted(read) == [3, 6] and last_loss > 0
    # the callbacks perturb nothing: the run ends where a plain run ends, and its last reading is that model
    for a, b in zip(plain.parameters(), swept.parameters()):
        assert torch.equal(a, b)
    assert torch.allclose(read[6], plain.eps(probe, 500, torch.tensor([0, 1])), atol=1e-6)
    assert not torch.allclose(read[3], read[6])  # three more steps moved the weights


@pytest.mark.parametrize("ema", [0.0, 0.9])
def test_a_run_cut_after_a_saved_state_resumes_to_the_weights_and_readings_of_an_uninterrupted_one(tmp_path, ema,
                                                                                                    monkeypatch):
    """train_ddpm(state=TrainState(...)): killed at its step-7 checkpoint (the state saved at step 4's), the
    same call again continues from step 4 (net, EMA, Adam, data generator, losses) and ends bit-equal to an
    uninterrupted run, with the same readings and loss; a file saved for other settings is refused, naming both.
    Asking the saved step and then resuming loads the file once."""
    from fedapp.models.checkpoints import TrainState
    from fedapp.models.ddpm import train_ddpm

    x, y = torch.randn(24, 3, 8, 8), torch.arange(24) % 3
    probe = torch.randn(2, 3, 8, 8)

    def fresh():
        torch.manual_seed(0)
        return DDPM(image_size=8, num_classes=3, block_out_channels=(8, 16), attention=False)

    def reading(read):
        return lambda step, m, loss: read.setdefault(step, (m.eps(probe, 500, torch.tensor([0, 1])).detach(), loss))

    whole, read_whole = fresh(), {}
    loss_whole = train_ddpm(whole, x, y, steps=10, batch=8, ema=ema, p_uncond=0.3, checkpoints=[4, 7, 10],
                            on_checkpoint=reading(read_whole))

    class Killed(Exception):
        pass

    def killed_at_7(step, m, loss):
        if step == 7:
            raise Killed

    state = TrainState(tmp_path / "s.pt", {"steps": 10, "ema": ema})
    with pytest.raises(Killed):
        train_ddpm(fresh(), x, y, steps=10, batch=8, ema=ema, p_uncond=0.3, checkpoints=[4, 7, 10],
                   on_checkpoint=killed_at_7, state=state)
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a[0]) or real_load(*a, **k))
    assert state.saved_step() == 4
    resumed, read_resumed = fresh(), {}
    loss_resumed = train_ddpm(resumed, x, y, steps=10, batch=8, ema=ema, p_uncond=0.3, checkpoints=[4, 7, 10],
                              on_checkpoint=reading(read_resumed), state=state)
    assert loads == [state.path]  # saved_step's load served restore too
    assert state.saved_step() == 10
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
    assert loss_resumed == loss_whole and sorted(read_resumed) == [7, 10]  # 4 was read before the cut
    for k in (7, 10):
        assert torch.equal(read_resumed[k][0], read_whole[k][0]) and read_resumed[k][1] == read_whole[k][1]
    with pytest.raises(ValueError, match="remove the file"):
        TrainState(tmp_path / "s.pt", {"steps": 20, "ema": ema}).saved_step()


def test_guidance_is_the_null_branch_plus_w_times_the_conditional_difference():
    m = DDPM(image_size=8, num_classes=3, block_out_channels=(8, 16), attention=False)
    calls = []

    def eps(x, t, y=None, flag=None):  # a stand-in network: its output is the label it was given
        calls.append(len(x))
        return torch.ones_like(x) * torch.as_tensor(y).float().view(-1, 1, 1, 1)

    m.eps = eps
    x, y = torch.zeros(4, 3, 8, 8), torch.tensor([0, 1, 2, 2])
    g = m.guided_eps(x, 10, y, guidance=3.0)
    assert torch.allclose(g[:, 0, 0, 0], -1 + 3 * (y.float() + 1)) and calls == [8]  # one batch of both
    calls.clear()
    assert torch.equal(m.guided_eps(x, 10, y, guidance=1.0)[:, 0, 0, 0], y.float()) and calls == [4]


def test_ema_leaves_the_model_at_the_moving_average_of_its_steps(monkeypatch):
    """train_ddpm(ema=d): the weights after training are the EMA of the per-step weights (the first step's
    taken as is, then d * avg + (1 - d) * w), recomputed here from a record of every step; ema=0 keeps the
    last step's."""
    from fedapp.models.ddpm import train_ddpm

    x, y = torch.randn(16, 3, 8, 8), torch.arange(16) % 2
    trail = []
    real_step = torch.optim.Adam.step

    def step(self, *a, **k):
        out = real_step(self, *a, **k)
        trail.append([p.detach().clone() for g in self.param_groups for p in g["params"]])
        return out

    monkeypatch.setattr(torch.optim.Adam, "step", step)
    for ema in (0.0, 0.5):
        trail.clear()
        torch.manual_seed(0)
        m = DDPM(image_size=8, num_classes=2, block_out_channels=(8, 16), attention=False)
        train_ddpm(m, x, y, steps=4, batch=8, ema=ema)
        want = trail[0]
        for w in trail[1:]:
            want = [ema * a + (1 - ema) * b for a, b in zip(want, w)] if ema else w
        assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(m.parameters(), want))
    assert not all(torch.allclose(p, q) for p, q in zip(m.parameters(), trail[-1]))  # not the last step's
