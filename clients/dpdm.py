"""Client of the `dpdm` baseline: PFDM's DP-SGD comparison (DPDM, Dockhorn et al. 2023, federated with
FedAvg, as PFDM's two-client MNIST table runs it). Options under `pfdm.*`; protocol: fedapp/protocols/pfdm.py.

Each round a client trains the global class-conditional DDPM for ceil(pfdm.local-steps / rounds) DP-SGD
steps through Opacus: Poisson sampling at rate q = min(1, pfdm.batch / n), per-sample gradients clipped
to pfdm.dp-clip, Gaussian noise of std pfdm.dp-noise x pfdm.dp-clip (0: the smallest multiplier that spends
pfdm.epsilon over all rounds), Adam. Its sampling and noise generators are seeded from the OS, never from
the run seed. It reports the epsilon spent so far: Opacus' RDP accountant for (multiplier, q, its steps so
far) at pfdm.delta. Not DPDM's: noise multiplicity (several levels per image and step) and EMA weights.
"""

from __future__ import annotations

import warnings

import torch
from flwr.app import Message, RecordDict

from clients.classify import train_reply
from clients.ddpm_baselines import global_ddpm, steps_per_round
from fedapp.client_context import ClientContext
from fedapp.models.ddpm import DDPM, LossTail
from fedapp.privacy import dpsgd_epsilon, dpsgd_noise_multiplier, os_torch_generator
from fedapp.protocols import pfdm as P


def train_ddpm_dpsgd(model: DDPM, x: torch.Tensor, y: torch.Tensor, *, steps: int, sample_rate: float,
                     noise_multiplier: float, max_grad_norm: float, lr: float, seed: int, device: str = "cpu") -> float:
    """`steps` DP-SGD (Adam) steps on the eps-MSE; returns the mean loss of the last 10% of steps. The
    diffusion levels and eps of the loss are seeded (training randomness); batches and noise are not."""
    from opacus import GradSampleModule
    from opacus.data_loader import DPDataLoader
    from opacus.optimizers import DPOptimizer

    model.to(device).train()
    private = os_torch_generator()
    loader = DPDataLoader(torch.utils.data.TensorDataset(x, y), sample_rate=sample_rate, generator=private)
    gsm = GradSampleModule(model)  # per-sample gradients by hooks on the layers (all supported: no attention)
    with warnings.catch_warnings():  # "Secure RNG turned off": its noise comes from an OS-seeded generator
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        opt = DPOptimizer(torch.optim.Adam(gsm.parameters(), lr=lr), noise_multiplier=noise_multiplier,
                          max_grad_norm=max_grad_norm, expected_batch_size=max(1, round(sample_rate * len(x))),
                          generator=private)
    g = torch.Generator().manual_seed(seed)
    tail, step = LossTail(steps), 0
    while step < steps:
        for xb, yb in loader:
            if step == steps:
                break
            opt.zero_grad(set_to_none=True)
            if len(xb):
                loss = model.loss(xb.to(device), yb.to(device), generator=g)
                with warnings.catch_warnings():  # Opacus hooks every layer, also those whose inputs (noisy
                    # image, timestep, label) need no gradient; its hook reads only the output gradient
                    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients")
                    loss.backward()
                tail.add(step, loss)
            else:  # an empty Poisson batch still takes a pure-noise step: no per-sample gradients, as Opacus' own
                for p in gsm.parameters():
                    if p.requires_grad:
                        p.grad_sample = p.new_zeros((0, *p.shape))
            opt.step()
            step += 1
    gsm.remove_hooks()  # the returned model is a plain DDPM again
    model.eval()
    return tail.mean()


def round_plan(n: int, o, rounds: int) -> tuple[int, float, float]:
    """(steps per round, sample rate q, noise multiplier) of a client with n training images."""
    steps = steps_per_round(o, rounds)
    q = min(1.0, o.batch / n)
    sigma = o.dp_noise or dpsgd_noise_multiplier(o.epsilon, o.delta, q, steps * rounds)
    return steps, q, sigma


def handle_train(msg: Message, ctx: ClientContext[P.PFDMOptions]) -> RecordDict:
    o, shard = ctx.cfg.options, ctx.shard
    rnd, model = global_ddpm(msg, ctx)
    steps, q, sigma = round_plan(len(shard.train), o, ctx.cfg.num_server_rounds)
    loss = train_ddpm_dpsgd(model, shard.train.x, shard.train.y, steps=steps, sample_rate=q, noise_multiplier=sigma,
                            max_grad_norm=o.dp_clip, lr=o.lr, seed=ctx.seed_for(rnd), device=ctx.device)
    return train_reply(model, len(shard.train), {P.TRAIN_LOSS_METRIC: loss, P.DP_NOISE_METRIC: sigma,
                                                 P.DP_EPSILON_METRIC: dpsgd_epsilon(sigma, q, steps * rnd, o.delta)})


HANDLERS = {P.DPDM_TRAIN.message_type: handle_train}
