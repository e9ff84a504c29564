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


def test_joint_label_embedding_shares_no_vector_between_label_tuples():
    """The ablation of the summed embedding: one row per (digit or null, colour or null) tuple. A step on
    (1, 2) moves the summed embedding's (1, 3) too (digit 1's vector is shared), never the joint one's."""
    from fedapp.models.nets import AttributeEmbedding, JointEmbedding

    torch.manual_seed(0)
    joint = JointEmbedding([10, 6], 4)
    assert joint.table.weight.shape == (11 * 7, 4)
    tuples = torch.tensor([[a, b] for a in range(-1, 10) for b in range(-1, 6)])
    assert len({tuple(v) for v in joint(tuples).tolist()}) == 77  # every tuple its own vector
    assert torch.equal(joint(torch.tensor([[-1, -1]])), joint.table.weight[-1:])  # null, null: the last row
    for emb in (joint, AttributeEmbedding([10, 6], 4)):
        before = emb(torch.tensor([[1, 3], [1, 2]])).detach()
        opt = torch.optim.SGD(emb.parameters(), lr=1.0)
        emb(torch.tensor([[1, 2]])).sum().backward()
        opt.step()
        after = emb(torch.tensor([[1, 3], [1, 2]])).detach()
        assert not torch.equal(after[1], before[1])
        assert torch.equal(after[0], before[0]) == isinstance(emb, JointEmbedding)
    try:
        joint(torch.tensor([[10, 0]]))
    except ValueError as e:
        assert "attribute 0" in str(e)
    else:
        raise AssertionError("a digit of 10 was embedded")


def test_image_net_takes_the_joint_embedding_by_name():
    net = ImageVelocityNet(8, [10, 4], block_out_channels=(16, 32), attention=False, label_embedding="joint")
    assert net.unet.class_embedding.table.weight.shape[0] == 11 * 5
    x = torch.randn(2, 3, 8, 8)
    assert net(x, torch.rand(2), torch.tensor([[3, 1], [-1, -1]])).shape == x.shape
