"""Espresso's research condition learners: what production's `clients.espresso.learn_conditions` is
compared with (tests, benchmarks/conditions.py, experiments/espresso_conditions.py). Not an experiment.

Every learner has `learn_conditions`' signature, (prior, z0, owner, init, *, steps, lr, batch, seed) ->
the learned conditions (E, L, D), so a caller hands one to `clients.espresso.espresso_upload(learner=...)`;
LEARNERS names them for `--settings steps:lr:batch:<learner>`.
"""

from __future__ import annotations

import torch

from clients.espresso import (ConditionLearner, condition_generator, condition_members, diffusion_loss, draw_rows,
                              learn_conditions)


def learn_conditions_loop(prior, z0: torch.Tensor, owner: torch.Tensor, init: torch.Tensor, *, steps: int,
                          lr: float, batch: int, seed: int) -> torch.Tensor:
    """The reference: Eq. (8) for one condition at a time, its own Adam and the same draws as the batched
    `learn_conditions` (what the test and benchmarks/conditions.py compare it with)."""
    device = prior.device
    z0 = z0.to(device, prior.dtype)
    out = []
    for e, m in enumerate(condition_members(owner, len(init))):
        c = init[e:e + 1].detach().clone().to(device, prior.dtype).requires_grad_(True)
        opt, g = torch.optim.Adam([c], lr=lr), condition_generator(seed, e)
        for _ in range(steps):
            idx, t, eps = draw_rows(g, m, batch, z0.shape[1:], prior.num_train_timesteps)
            loss = diffusion_loss(prior, z0[idx.to(device)], c.expand(len(idx), -1, -1), t.to(device),
                                  eps.to(device, prior.dtype))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        out.append(c.detach().cpu())
    return torch.cat(out)


def learn_conditions_minibatch(prior, z0: torch.Tensor, owner: torch.Tensor, init: torch.Tensor, *, steps: int,
                               lr: float, batch: int, seed: int) -> torch.Tensor:
    """The learner before batching (kept to compare with): `batch` images drawn over the whole client
    per step, each row with its image's condition, so a condition gets a gradient only in the steps
    that draw one of its images (100 steps, lr 0.01, batch 32 were its defaults)."""
    c = init.detach().clone().to(prior.device, prior.dtype).requires_grad_(True)
    opt, g = torch.optim.Adam([c], lr=lr), torch.Generator().manual_seed(seed)
    z0, owner = z0.to(prior.device, prior.dtype), owner.to(prior.device)
    for _ in range(steps):
        idx = torch.randint(0, len(z0), (batch,), generator=g).to(prior.device)
        t = torch.randint(0, prior.num_train_timesteps, (batch,), generator=g).to(prior.device)
        eps = torch.randn(batch, *z0.shape[1:], generator=g).to(prior.device, prior.dtype)
        loss = diffusion_loss(prior, z0[idx], c[owner[idx]], t, eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return c.detach().cpu()


# the learners experiments/espresso_conditions.py's --settings name: `batched` is production's
LEARNERS: dict[str, ConditionLearner] = {"batched": learn_conditions, "minibatch": learn_conditions_minibatch}
