"""The helpers the one-shot and generation strategies share (strategies/oneshot.py,
strategies/generation_eval.py), on tensors, without a federation."""

import torch

from strategies.generation_eval import MEMO_RATIO, memorisation, unit
from strategies.oneshot import parameter_bytes, train_global_classifier


def _two_colours(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Class 0: a dark image, class 1: a bright one, plus noise: a task any classifier learns."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    x = (y.float() * 1.2 - 0.6).view(-1, 1, 1, 1) + 0.1 * torch.randn(n, 3, 16, 16, generator=g)
    return x.clamp(-1, 1), y


def test_the_global_classifier_learns_what_it_is_trained_on():
    x, y = _two_colours(64, seed=0)
    model = train_global_classifier("cnn", x, y, num_classes=2, epochs=3, seed=0)
    xt, yt = _two_colours(64, seed=1)
    with torch.no_grad():
        assert (model(xt).argmax(1) == yt).float().mean() == 1.0
    assert not model.training  # returned ready to evaluate
    state = model.state_dict()
    assert parameter_bytes(model) == sum(t.numel() * t.element_size() for t in state.values()) > 0


def test_memorisation_flags_copies_and_not_strangers():
    g = torch.Generator().manual_seed(0)
    train = torch.randn(20, 3, 8, 8, generator=g)
    assert torch.allclose(unit(train).norm(dim=1), torch.ones(20, dtype=torch.float64))
    copies = memorisation(train[:5] * 3.0, train)  # the scale does not matter: distances on unit vectors
    assert copies["memorised_fraction"] == 1.0 and copies["nn_distance"] < 1e-6
    strangers = memorisation(torch.randn(50, 3, 8, 8, generator=g), train)
    assert strangers["memorised_fraction"] == 0.0  # nearest never < MEMO_RATIO x the second nearest
    assert strangers["nn_distance"] > MEMO_RATIO
