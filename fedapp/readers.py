"""Evaluation readers: the small CNNs that read generated samples (their class, digit, colour or domain).

A reader is trained once per (dataset, image size, seed, attribute, epochs, width, recipe, training data)
and cached as a state dict under <cache>/readers/ (`cache_dir`); its accuracy on held-out real images
is measured each time it is handed out, so that a run can say whether the reader behind its figures is
trustworthy: below its THRESHOLDS, `reader_metrics` marks the figures `reader_unreliable` and logs one
WARNING line. A reader never sees the images its accuracy is measured on.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from fedapp.models import classifier
from fedapp.models.cache import cache_home, facts_digest
from fedapp.models.classifier import SmallCNN, accuracy, train_classifier

log = logging.getLogger("fedapp")

LABEL = "label"  # the class label (a Split's y); any other attribute names one of a Split's attrs
THRESHOLDS = {"color": 0.99, "domain": 0.95}  # held-out accuracy a reader needs
DEFAULT_THRESHOLD = 0.97  # digit and class readers
CACHE_ENV = "FEDAPP_READER_CACHE"  # overrides <cache home>/readers (the tests point it at a tmp dir)

Data = tuple[torch.Tensor, torch.Tensor]  # (x (N, C, H, W), labels (N,))


@dataclass(frozen=True)
class Reader:
    attribute: str
    model: nn.Module  # in eval mode
    held_out_accuracy: float
    threshold: float

    @property
    def reliable(self) -> bool:
        return self.held_out_accuracy >= self.threshold


def cache_dir() -> Path:
    return Path(os.environ[CACHE_ENV]).expanduser() if os.environ.get(CACHE_ENV) else cache_home() / "readers"


def _fingerprint(x: torch.Tensor, y: torch.Tensor) -> str:
    h = hashlib.sha256(str((tuple(x.shape), tuple(y.shape))).encode())
    h.update(x.detach().cpu().contiguous().numpy())
    h.update(y.detach().cpu().contiguous().numpy())
    return h.hexdigest()


def cache_key(facts: dict[str, Any], model: nn.Module, train: Data) -> str:
    """Hash of the facts, the untrained model (its architecture: class source and layer sizes), the
    training recipe's source and the training data: a change to any of them is a new entry."""
    code = inspect.getsource(type(model)) + repr(model) + inspect.getsource(classifier.train_classifier)
    facts = {**facts, "code": hashlib.sha256(code.encode()).hexdigest(), "data": _fingerprint(*train)}
    return facts_digest(facts, 16)


def _load(path: Path, untrained: nn.Module) -> nn.Module | None:
    """The cached reader, weights only (no pickle); a file that does not load (or fit) is reported and
    retrained. Loaded into a copy: `untrained` stays as built, to be trained."""
    if not path.is_file():
        return None
    try:
        model = copy.deepcopy(untrained)
        model.load_state_dict(torch.load(path, weights_only=True))
        return model
    except Exception as err:  # truncated, corrupted or of another shape: all mean "train it again"
        log.warning("reader cache %s unreadable (%s: %s); retraining", path, type(err).__name__, err)
        return None


def _save(path: Path, model: nn.Module) -> None:
    """Through a temporary file and a rename: a reader of the cache never sees half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, f)
        os.replace(tmp, path)
    except OSError as err:  # the cache saves time, never a run
        log.warning("reader cache %s not written (%s)", path, err)


def shift_for(image_size: int) -> int:
    """The readers' augmentation: a shift of up to 1/14 of the side (2 px at 28, 1 px at 16 and below)."""
    return max(1, round(image_size / 14))


def reader(dataset: str, image_size: int, seed: int, attribute: str = LABEL, *, epochs: int, num_classes: int,
           train: Data, test: Data, width: int = 32) -> Reader:
    """A SmallCNN reading `attribute`, trained on `train` (or loaded from the cache), with its accuracy
    on `test`, held-out real images it never saw."""
    x, y = train[0].float(), train[1].long()
    torch.manual_seed(seed)  # built (and the global generator advanced) alike whether then loaded or trained
    untrained = SmallCNN(num_classes, in_ch=x.shape[1], width=width)
    facts = {"dataset": dataset, "image_size": image_size, "seed": seed, "attribute": attribute, "epochs": epochs,
             "width": width, "num_classes": num_classes}
    path = cache_dir() / f"{dataset}-{attribute}-{cache_key(facts, untrained, (x, y))}.pt"
    model = _load(path, untrained)
    if model is None:
        model = train_classifier(untrained, x, y, epochs=epochs, seed=seed, shift=shift_for(x.shape[-1]))
        _save(path, model)
    acc = accuracy(model.eval(), test[0].float(), test[1].long())
    log.info("reader %s of %s: held-out accuracy %.4f (%s)", attribute, dataset, acc, path.name)
    return Reader(attribute, model, acc, THRESHOLDS.get(attribute, DEFAULT_THRESHOLD))


def _labels(split, attribute: str) -> torch.Tensor:
    return split.y if attribute == LABEL else torch.as_tensor(split.attrs[attribute])


def reader_split(server):
    """The real images a reader of `server`'s dataset trains on: every one outside the test split (the
    public part and the client pool). A reader is an evaluation instrument, like FID's Inception network,
    not part of any method; on the 750 public digits of mnist-5k alone it reads 94-96 % of the held-out
    digits (docs/recipe.md), under the 97 % a table needs."""
    return _outside_test(server.info.name, server.public.x.shape[-1])


@functools.lru_cache(maxsize=1)
def _outside_test(dataset: str, size: int):
    """Decoded once for the readers of one dataset (DCFM reads digit and colour off the same images); read only."""
    import numpy as np

    from feddata.sources import base_split, load_base

    parts = base_split(dataset, size)
    return load_base(dataset, size).split(np.sort(np.concatenate([parts["public"], parts["pool"]])))


def server_reader(server, seed: int, attribute: str = LABEL, *, epochs: int, width: int = 32) -> Reader:
    """A reader of `attribute` trained on a feddata ServerData's dataset outside its test split (reader_split),
    measured on its test split."""
    info, train, test = server.info, reader_split(server), server.test
    k = info.num_classes if attribute == LABEL else len(info.attributes[attribute])
    return reader(info.name, train.x.shape[-1], seed, attribute, epochs=epochs, num_classes=k, width=width,
                  train=(train.x, _labels(train, attribute)), test=(test.x, _labels(test, attribute)))


def reader_metrics(readers: Iterable[Reader]) -> dict[str, Any]:
    """A run's reader figures: each reader's held-out accuracy, and `reader_unreliable` (with which
    readers) when one is below its threshold, which one WARNING line also says."""
    readers = list(readers)
    weak = [r for r in readers if not r.reliable]
    if weak:
        log.warning("reader_unreliable: %s on held-out real images; the figures they read are not to be trusted",
                    ", ".join(f"{r.attribute} reader {r.held_out_accuracy:.4f} < {r.threshold}" for r in weak))
    return {"reader_accuracy": {r.attribute: r.held_out_accuracy for r in readers},
            "reader_unreliable": bool(weak), "unreliable_readers": [r.attribute for r in weak]}
