"""strategies/pfdm_attacks.py: the reconstruction attack's scoring (a perfect release is caught, pure noise
is not), z_w's own generations (shape, range, repeatable), and the same-class negative it scores against."""

from types import SimpleNamespace

import torch

from feddata.types import Split
from fedapp.models.ddpm import build_ddpm
from fedapp.protocols import pfdm as P
from strategies.pfdm_attacks import reconstruction, same_class_other, shared_generation

SIZE, CLASSES, N = 8, 3, 24


def _fakes(seed: int = 0):
    """The collaborators reconstruction reads, reduced to the fields it uses: a server run (config, options,
    device), an evaluator (public split, class count, a grid writer) and client 0's training shard."""
    g = torch.Generator().manual_seed(seed)
    truth = Split(torch.rand(N, 3, SIZE, SIZE, generator=g) * 2 - 1, torch.arange(N) % CLASSES)
    public = Split(torch.rand(16, 3, SIZE, SIZE, generator=g) * 2 - 1, torch.arange(16) % CLASSES)
    opts = SimpleNamespace(attack_samples=N, clip=100.0, channels="8,16", shared_steps=2, batch=8, lr=1e-3,
                           sample_steps=1, ema=0.0, p_uncond=0.0)
    run = SimpleNamespace(cfg=SimpleNamespace(options=opts, image_size=SIZE, seed=seed), device="cpu")
    saved = []
    ev = SimpleNamespace(server=SimpleNamespace(public=public), num_classes=CLASSES,
                         save_rows=lambda x, rows, name: saved.append((name, x.shape)))
    return run, ev, [SimpleNamespace(train=truth)], saved


def test_reconstruction_identifies_a_release_that_is_the_image_and_not_one_that_is_noise():
    run, ev, shards, saved = _fakes()
    truth = shards[0].train
    # t0 = 1: a release is x at abar_1 = 1 - 1e-4, so one denoising step returns the image whatever the
    # attacker learnt: every image is identified, far above chance
    exact = {0: {P.X: truth.x.clone(), P.Y: truth.y.clone()}}
    m = reconstruction(run, 1, ev, exact, shards)
    assert m["recon_identified"] == 1.0 and m["recon_closer_than_random"] == 1.0
    assert m["recon_true_distance"] < 0.05 < m["recon_random_distance"]
    assert m["recon_identified_chance"] == 1 / N
    assert saved == [("reconstruction.png", (16, 3, SIZE, SIZE))]
    # a release that carries nothing of the image: identification near chance, no closer than a random image
    noise = {0: {P.X: torch.randn(N, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(5)), P.Y: truth.y}}
    m = reconstruction(run, 1, ev, noise, shards)
    assert m["recon_identified"] <= 3 / N
    assert m["recon_true_distance"] > 0.5


def test_same_class_other_is_another_image_of_the_class_or_itself_when_alone():
    y = torch.tensor([0, 1, 0, 2, 0, 1])
    g = torch.Generator().manual_seed(0)
    for i in range(len(y)):
        picks = {int(same_class_other(y, i, g)) for _ in range(50)}
        expected = {j for j in range(len(y)) if y[j] == y[i] and j != i} or {i}
        assert picks == expected  # every other same-class image is drawn, nothing else


def test_shared_generation_relative_is_an_image_estimate_and_algorithm2_a_release_like_sample():
    torch.manual_seed(0)
    shared = build_ddpm(SIZE, CLASSES, channels="8,16").eval()
    y = torch.arange(6) % CLASSES
    rel = shared_generation(shared, y, 300, "relative", 4, torch.Generator().manual_seed(1))
    assert rel.shape == (6, 3, SIZE, SIZE) and rel.min() >= -1 and rel.max() <= 1
    again = shared_generation(shared, y, 300, "relative", 4, torch.Generator().manual_seed(1))
    assert torch.equal(rel, again)  # seeded: the attack figures repeat
    alg2 = shared_generation(shared, y, 300, "algorithm2", 4, torch.Generator().manual_seed(1))
    assert alg2.shape == rel.shape and not torch.allclose(alg2, rel)
