"""A small CNN classifier: the reference classifier (sample accuracy, Frechet distance features)
and a light client model. GroupNorm instead of BatchNorm so the state dict has no running
statistics: FedAvg averages parameters only, and eval equals train behaviour. The transformers ResNets
(FedDifRC's paper backbone) keep their BatchNorm; FedAvg averages its running statistics with the weights."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F


POOL = 4  # the spatial grid the head reads (7x7 at 28 px, 4x4 at 16 px before pooling)


class SmallCNN(nn.Module):
    """conv-GN-ReLU x2 at full size, then two downsampling stages, a 4x4 spatial pooling, a linear
    layer to the embedding and a linear head. `embed(x)` is that embedding, (B, 4*width).

    The recipe measured by `python -m experiments recipe` (docs/recipe.md): the 4x4 pooling keeps where
    the strokes are (a global average pool threw it away and left the first hundred SGD steps at chance on
    28 px MNIST, FedAvg at chance for rounds), and GroupNorm takes the GN paper's 32 groups (8 learned
    later and less evenly). `head="gap"`, `groups=8` is the old recipe, kept for that comparison."""

    def __init__(self, num_classes: int, in_ch: int = 3, width: int = 32, groups: int = 32, head: str = "spatial"):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(min(groups, cout), cout),
                                 nn.ReLU(inplace=True))

        c = 4 * width
        pool = [nn.AdaptiveAvgPool2d(1), nn.Flatten()] if head == "gap" else \
            [nn.AdaptiveAvgPool2d(POOL), nn.Flatten(), nn.Linear(c * POOL * POOL, c), nn.ReLU(inplace=True)]
        self.features = nn.Sequential(
            block(in_ch, width), block(width, width), nn.MaxPool2d(2),
            block(width, 2 * width), block(2 * width, 2 * width), nn.MaxPool2d(2),
            block(2 * width, c), *pool)
        self.head = nn.Linear(c, num_classes)
        self.embed_dim = c

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def random_shift(x: torch.Tensor, shift: int, generator: torch.Generator) -> torch.Tensor:
    """Each image of x (N, C, H, W) translated by its own (dy, dx) in [-shift, shift]², the border pixels
    repeated into the gap (a digit's background, not a black frame)."""
    n, _, h, w = x.shape
    padded = F.pad(x, (shift, shift, shift, shift), mode="replicate")
    dy, dx = torch.randint(0, 2 * shift + 1, (2, n), generator=generator)
    rows = (dy[:, None] + torch.arange(h))[:, None, :, None]  # (N, 1, H, 1)
    cols = (dx[:, None] + torch.arange(w))[:, None, None, :]  # (N, 1, 1, W)
    return padded[torch.arange(n)[:, None, None, None], torch.arange(x.shape[1])[None, :, None, None], rows, cols]


def minibatches(perm: torch.Tensor, batch: int, model: nn.Module) -> list[torch.Tensor]:
    """`perm` cut into training minibatches of `batch` indices. With BatchNorm in `model` (the transformers
    ResNets) a trailing batch of one joins the one before: BatchNorm cannot train on one sample, and a shard
    of 16k + 1 images would fail its client every round. Models without BatchNorm keep the plain split, so
    the CNN tables measured before this rule are reproduced step for step."""
    chunks = list(torch.split(perm, batch))
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if has_batchnorm and len(chunks) > 1 and len(chunks[-1]) == 1:
        chunks[-2:] = [torch.cat(chunks[-2:])]
    return chunks


def train_classifier(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int = 10, lr: float = 2e-3,
                     batch: int = 64, seed: int = 0, weight_decay: float = 1e-4,
                     progress: str | None = None, on_epoch: Callable[[int, nn.Module], None] | None = None,
                     shift: int = 0) -> nn.Module:
    """AdamW with a cosine learning rate over `epochs` passes of shuffled minibatches (seeded);
    `progress` names the epochs in progress lines with an ETA (fedapp.progress), e.g. on the server;
    `on_epoch(epoch, model)` after each pass (a learning curve; it may switch the model to eval);
    `shift` > 0 moves each training image by up to that many pixels (random_shift), the augmentation
    that takes the recipe past 98 % on 28 px digits (docs/recipe.md)."""
    from fedapp.progress import track

    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    total = epochs * max(1, len(minibatches(torch.arange(len(x)), batch, model)))  # the steps the loop takes
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total)
    model.train()
    for epoch in (track(range(epochs), progress, eta=True) if progress else range(epochs)):
        perm = torch.randperm(len(x), generator=g)
        for idx in minibatches(perm, batch, model):
            xb = random_shift(x[idx], shift, g) if shift else x[idx]
            loss = F.cross_entropy(model(xb.to(device)), y[idx].to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        if on_epoch is not None:
            on_epoch(epoch, model)
            model.train()
    return model.eval()


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor, batch: int = 512) -> torch.Tensor:
    """Predicted labels (N,) for x (N, C, H, W)."""
    model.eval()
    device = next(model.parameters()).device
    return torch.cat([model(x[i:i + batch].to(device)).argmax(1).cpu() for i in range(0, len(x), batch)])


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((predict(model, x) == y.cpu()).float().mean())


# The built-in CNNs: `cnn` the recipe, `cnn-gap` the one before it (global average pool, 8 groups), which
# FedAvg could not train on 28 px MNIST; kept so that `python -m experiments recipe` can show the difference.
CNNS: dict[str, dict[str, Any]] = {"cnn": {}, "cnn-gap": {"head": "gap", "groups": 8}}

# Built-in ResNets from a transformers config (random init, no download): basic blocks, widths 64..512.
# ResNet-10 (one block per stage) is FedDifRC's client model in the paper's code; ResNet-18 the usual one.
RESNET_DEPTHS = {"resnet10": [1, 1, 1, 1], "resnet18": [2, 2, 2, 2]}


class HFResNet(nn.Module):
    """ResNet from transformers: a built-in layout (RESNET_DEPTHS) or loaded by id/folder."""

    def __init__(self, num_classes: int, name_or_path: str | None = None, depths: list[int] | None = None):
        super().__init__()
        from transformers import ResNetConfig, ResNetModel

        if name_or_path:
            self.backbone = ResNetModel.from_pretrained(name_or_path)
        else:
            self.backbone = ResNetModel(ResNetConfig(
                layer_type="basic", depths=depths or RESNET_DEPTHS["resnet18"], hidden_sizes=[64, 128, 256, 512],
                embedding_size=64, num_channels=3))
        self.embed_dim = self.backbone.config.hidden_sizes[-1]
        self.head = nn.Linear(self.embed_dim, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(pixel_values=x).pooler_output.flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


class ProjectedClassifier(nn.Module):
    """A classifier plus a projection head g: embedding -> R^proj_dim (z_i of MOON and FedDifRC).

    The head sits beside the classifier's own head (logits come from the embedding, as in FedDifRC's
    code); FedAvg averages it with the rest. proj_dim = 0: no head, z is the embedding itself
    (FedDifRC's official code regularises the backbone's feature). `forward` keeps the last embedding in
    `self.embedding` so a regulariser takes z = project(model.embedding) without a second backbone pass."""

    def __init__(self, base: nn.Module, proj_dim: int):
        super().__init__()
        e = base.embed_dim
        self.base = base
        self.proj = nn.Sequential(nn.Linear(e, e), nn.ReLU(inplace=True), nn.Linear(e, proj_dim)) if proj_dim \
            else nn.Identity()
        self.embed_dim, self.proj_dim = e, proj_dim or e
        self.embedding: torch.Tensor | None = None

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.embed(x)

    def project(self, embedding: torch.Tensor) -> torch.Tensor:
        return self.proj(embedding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.embedding = self.base.embed(x)
        return self.base.head(self.embedding)


def build_classifier(name: str, num_classes: int, proj_dim: int = 0, keep_embedding: bool = False) -> nn.Module:
    """`cnn` (or `cnn-gap`), `resnet10`, `resnet18` (transformers config, random init) or a transformers
    ResNet id/folder. proj_dim > 0 wraps it in a ProjectedClassifier with that projection head;
    keep_embedding alone wraps it without a head (z = the embedding)."""
    if proj_dim > 0 or keep_embedding:
        return ProjectedClassifier(build_classifier(name, num_classes), proj_dim)
    if name in CNNS:
        return SmallCNN(num_classes, **CNNS[name])
    if name in RESNET_DEPTHS:
        return HFResNet(num_classes, depths=RESNET_DEPTHS[name])
    return HFResNet(num_classes, name_or_path=name)


def embedding_dim(name: str) -> int:
    """The embedding size of a built-in classifier without building it (FedDifRC sizes its targets by it)."""
    if name in CNNS:
        return SmallCNN(1, **CNNS[name]).embed_dim
    if name in RESNET_DEPTHS:
        return 512
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(name).hidden_sizes[-1])


@torch.no_grad()
def embed_all(model: nn.Module, x: torch.Tensor, batch: int = 512) -> torch.Tensor:
    """Penultimate features of `x` in eval mode (reference features for Frechet distances)."""
    model.eval()
    device = next(model.parameters()).device
    return torch.cat([model.embed(x[i:i + batch].to(device)).cpu() for i in range(0, len(x), batch)])
