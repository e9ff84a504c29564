"""Flow matching pieces for DCFM: path/target equations, samplers, the velocity nets."""

import torch

from fedapp.models.flow import (ImageVelocityNet, VectorVelocityNet, euler, fm_loss, midpoint, sample_path,
                                 target_velocity)


def test_path_and_target_equations():
    x0, x1 = torch.randn(4, 2), torch.randn(4, 2)
    t = torch.tensor([0.0, 0.25, 0.5, 1.0])
    xt = sample_path(x0, x1, t)
    assert torch.allclose(xt[0], x0[0]) and torch.allclose(xt[3], x1[3])
    assert torch.allclose(xt[1], 0.25 * x1[1] + 0.75 * x0[1])
    u = target_velocity(x0, x1)
    h = 1e-3  # u_t is the time derivative of the path
    assert torch.allclose((sample_path(x0, x1, t + h) - sample_path(x0, x1, t)) / h, u, atol=1e-3)


def test_euler_and_midpoint_exact_on_constant_and_linear_fields():
    c = torch.tensor([[1.0, -2.0]])
    x0 = torch.zeros(3, 2)
    assert torch.allclose(euler(lambda x, t: c.expand_as(x), x0, steps=7), c.expand(3, 2), atol=1e-6)
    # v = t (per coordinate): x(1) = 1/2; midpoint integrates it exactly, Euler does not
    v = lambda x, t: t[:, None].expand_as(x)  # noqa: E731
    assert torch.allclose(midpoint(v, x0, steps=3), torch.full((3, 2), 0.5), atol=1e-6)
    assert not torch.allclose(euler(v, x0, steps=3), torch.full((3, 2), 0.5), atol=1e-3)
    x, path = euler(lambda x, t: c.expand_as(x), x0, steps=4, return_path=True)
    assert path.shape == (5, 3, 2) and torch.equal(path[-1], x)


def test_vector_net_learns_and_masks():
    torch.manual_seed(0)
    net = VectorVelocityNet(dim=2, attribute_sizes=[2, 2], hidden=64)
    y = torch.tensor([[0, 1], [-1, 1], [-1, -1]])
    assert net(torch.randn(3, 2), torch.rand(3), y).shape == (3, 2)
    assert torch.allclose(net(torch.zeros(1, 2), torch.zeros(1)), net(torch.zeros(1, 2), torch.zeros(1),
                                                                          torch.tensor([[-1, -1]])))
    x1 = torch.tensor([[2.0, 2.0]]).repeat(128, 1) + 0.1 * torch.randn(128, 2)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    first = None
    for _ in range(100):
        loss = fm_loss(net, x1, torch.tensor([[1, 1]]).repeat(128, 1))
        opt.zero_grad(), loss.backward(), opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < 0.5 * first
    out = midpoint(lambda x, t: net(x, t, torch.tensor([[1, 1]]).repeat(len(x), 1)), torch.randn(256, 2), steps=10)
    assert (out.mean(0) - torch.tensor([2.0, 2.0])).abs().max() < 0.3


def test_image_net_shapes():
    torch.manual_seed(0)
    net = ImageVelocityNet(8, [10, 4], block_out_channels=(16, 32), attention=False)
    x = torch.randn(3, 3, 8, 8)
    v = net(x, torch.rand(3), torch.tensor([[3, 1], [-1, 2], [-1, -1]]))
    assert v.shape == x.shape and torch.isfinite(v).all()
    loss = fm_loss(net, x, torch.tensor([[3, 1], [4, 2], [5, 0]]))
    loss.backward()
    assert net.unet.class_embedding.tables[0].weight.grad is not None
