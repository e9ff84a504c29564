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
