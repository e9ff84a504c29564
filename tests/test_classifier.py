"""The built-in classifiers: sizes, the embedding a regulariser reads, ResNet-10's layout."""

import pytest
import torch

from fedapp.models.classifier import ProjectedClassifier, build_classifier, embedding_dim


@pytest.mark.parametrize("name, blocks", [("resnet10", [1, 1, 1, 1]), ("resnet18", [2, 2, 2, 2])])
def test_resnets_from_transformers_configs(name, blocks):
    torch.manual_seed(0)
    model = build_classifier(name, 10)
    assert model.backbone.config.depths == blocks and model.backbone.config.layer_type == "basic"
    assert [len(stage.layers) for stage in model.backbone.encoder.stages] == blocks
    assert model(torch.randn(2, 3, 28, 28)).shape == (2, 10)  # 28 px digits pass the stride-32 stem
    assert model.embed(torch.randn(2, 3, 28, 28)).shape == (2, 512) == (2, embedding_dim(name))
    n10 = sum(p.numel() for p in build_classifier("resnet10", 10).parameters())
    n18 = sum(p.numel() for p in build_classifier("resnet18", 10).parameters())
    assert n10 < 0.5 * n18  # one basic block per stage instead of two


def test_projected_classifier_with_and_without_a_head():
    x = torch.randn(3, 3, 16, 16)
    bare = build_classifier("cnn", 4, keep_embedding=True)
    assert isinstance(bare, ProjectedClassifier) and bare.proj_dim == bare.embed_dim == embedding_dim("cnn")
    logits = bare(x)
    assert torch.equal(bare.project(bare.embedding), bare.embedding) and logits.shape == (3, 4)
    assert not any(k.startswith("proj.") for k in bare.state_dict())
    head = build_classifier("cnn", 4, proj_dim=24)
    head(x)
    assert head.project(head.embedding).shape == (3, 24) and any(k.startswith("proj.") for k in head.state_dict())
    assert type(build_classifier("cnn", 4)).__name__ == "SmallCNN"


@pytest.mark.parametrize("size", [8, 16, 28])
def test_cnn_recipe_reads_a_spatial_grid_at_every_size(size):
    """The recipe's head reads a 4x4 grid of the last feature map (the embedding keeps where strokes are);
    its GroupNorm layers take 32 groups where the channels allow; cnn-gap is the global-pool recipe before it."""
    from torch import nn

    from fedapp.models.classifier import POOL, SmallCNN

    net = build_classifier("cnn", 10)
    x = torch.randn(2, 3, size, size)
    assert net(x).shape == (2, 10) and net.embed(x).shape == (2, net.embed_dim) == (2, embedding_dim("cnn"))
    pools = [m for m in net.features if isinstance(m, nn.AdaptiveAvgPool2d)]
    assert [p.output_size for p in pools] == [POOL]
    assert {m.num_groups for m in net.modules() if isinstance(m, nn.GroupNorm)} == {32}
    old = build_classifier("cnn-gap", 10)
    assert [m.output_size for m in old.features if isinstance(m, nn.AdaptiveAvgPool2d)] == [1]
    assert {m.num_groups for m in old.modules() if isinstance(m, nn.GroupNorm)} == {8}
    assert old.embed(x).shape == (2, embedding_dim("cnn-gap")) == (2, net.embed_dim)
    assert {m.num_groups for m in SmallCNN(4, width=16).modules() if isinstance(m, nn.GroupNorm)} == {16, 32}


def test_train_classifier_reports_every_epoch():
    from fedapp.models.classifier import SmallCNN, train_classifier

    seen = []
    torch.manual_seed(0)
    x, y = torch.randn(20, 3, 8, 8), torch.arange(20) % 2
    model = train_classifier(SmallCNN(2, width=8), x, y, epochs=3, batch=8,
                             on_epoch=lambda e, m: seen.append((e, m.training)))
    assert [e for e, _ in seen] == [0, 1, 2] and all(training for _, training in seen)
    assert not model.training


def test_the_recipe_learns_real_digits_where_the_old_one_sits_at_chance():
    """Two epochs of a client's SGD (lr 0.02, momentum 0.9, batch 16) on 1,000 real 28 px MNIST digits: the
    recipe reads held-out digits far above chance, the global-pool recipe does not leave it (docs/recipe.md)."""
    import feddata
    from clients.classify import local_train
    from fedapp.models.classifier import accuracy

    shard = feddata.load_client_shard("mnist-5k", "iid", {"per-class": 0}, 0, 0, 3)
    x, y, tx, ty = shard.train.x[:1000], shard.train.y[:1000], shard.test.x[:300], shard.test.y[:300]
    acc = {}
    for name in ("cnn", "cnn-gap"):
        torch.manual_seed(0)
        net = build_classifier(name, 10)
        local_train(net, x, y, epochs=2, lr=0.02, batch=16, seed=0)
        acc[name] = accuracy(net, tx, ty)
    assert acc["cnn"] > 0.7 and acc["cnn-gap"] < 0.35, acc  # measured: 0.85 and 0.26


def test_random_shift_translates_each_image_by_at_most_shift_pixels():
    from fedapp.models.classifier import random_shift

    x = torch.randn(32, 3, 10, 10)
    out = random_shift(x, 2, torch.Generator().manual_seed(0))
    assert out.shape == x.shape
    offsets = set()
    for k in range(len(x)):
        found = [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)
                 if torch.equal(out[k, :, 2:8, 2:8], x[k, :, 2 + dy:8 + dy, 2 + dx:8 + dx])]
        assert found, k  # the centre is the input moved by (dy, dx); the border repeats the edge
        offsets.add(found[0])
    assert len(offsets) > 5  # each image its own draw


def test_a_batchnorm_resnet_trains_a_shard_that_leaves_one_image_over():
    """17 images in batches of 16 left a last batch of one, which BatchNorm refuses: the ResNet client failed
    every round it was sampled. Now the one joins the batch before, every image is still seen once an epoch,
    and a model without BatchNorm keeps the plain split (its older tables reproduce step for step)."""
    from clients.classify import local_train
    from fedapp.models.classifier import minibatches

    perm = torch.randperm(17, generator=torch.Generator().manual_seed(0))
    resnet, cnn = build_classifier("resnet10", 10), build_classifier("cnn", 10)
    merged, plain = minibatches(perm, 16, resnet), minibatches(perm, 16, cnn)
    assert [len(b) for b in merged] == [17] and [len(b) for b in plain] == [16, 1]
    assert sorted(torch.cat(merged).tolist()) == list(range(17))
    assert [len(b) for b in minibatches(perm, 8, resnet)] == [8, 9]
    assert [len(b) for b in minibatches(perm[:16], 8, resnet)] == [8, 8]

    x, y = torch.randn(17, 3, 28, 28), torch.arange(17) % 10
    before = [p.detach().clone() for p in resnet.parameters()]
    stats = local_train(resnet, x, y, epochs=1, lr=0.01, batch=16, seed=0)
    assert stats["ce"] > 0 and any(not torch.equal(a, b) for a, b in zip(before, resnet.parameters()))
