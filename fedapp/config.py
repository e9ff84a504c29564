"""The run config: typed dataclasses, validated before anything heavy starts.

Flower hands the app a flat dict (`context.run_config`, keys like `num-server-rounds`,
`partitioner.alpha`, `espresso.clusters`). `parse_run_config` turns it into a `RunConfig`
and raises one `ConfigError` line naming the key, the value and what is allowed.

Method options live in each method's protocol module (fedapp/protocols/<m>.py: a dataclass whose
fields carry `opt(...)` metadata); the method's MethodSpec (fedapp.registry) names it and its namespace.
A run keeps, and sends its clients, the common keys, the app's namespaces and its method's namespace only.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Mapping, TypeVar, overload

from feddata.api import SEED
from feddata.partition import PARAMS, PARTITIONER, PARTITIONER_PARAMS
from feddata.sources import IMAGE_SIZE

from fedapp.options import (AUTO, PARTITIONER_KEY, ConfigError, Rule, build_options,  # noqa: F401 (re-exported)
                            declared, flat_defaults, opt, option_values, refuse, resolve)
from fedapp.registry import MethodSpec

# image-size and classifier-size: feddata's one image-size rule, or "auto"
_SIZE = dataclasses.replace(IMAGE_SIZE, default=AUTO, auto=True)


@dataclass(frozen=True)
class CommonConfig:
    """Keys every method shares. Flower's own key for rounds is `num-server-rounds`."""

    method: str = opt("espresso", help="which method/baseline runs (see fedapp.registry)")
    dataset: str = opt("digit-styles", help="built-in source, hub id or local folder")
    partitioner: str = declared(dataclasses.replace(PARTITIONER, default="domain"), key=PARTITIONER_KEY)
    seed: int = declared(SEED)
    out_dir: str = opt("runs", help="results land in <out-dir>/<run-name>/")
    run_name: str = opt("", help="empty: <method>-<dataset>-<partitioner>-s<seed>-<time>")
    model: str = opt("cnn", help="classifier: cnn (cnn-gap: the recipe before docs/recipe.md), resnet10, resnet18, "
                                 "or a transformers ResNet id/folder")
    image_size: int | str = declared(_SIZE, help="pixels per side; auto: the prior's size for methods with a prior, "
                                                 "else the dataset's native size")
    classifier_size: int | str = declared(_SIZE, help="pixels per side the classifier sees: real images are decoded "
                                                      "at it and synthetic ones resized to it, while a prior reads and "
                                                      "samples at image-size; auto: image-size")
    num_server_rounds: int = opt(5, low=1, help="rounds of the round-based methods (FedAvg family, fedflow, "
                                                "fedavg-ddpm, dpdm); one-shot methods ignore it")
    local_epochs: int = opt(3, low=1, help="classification methods: epochs of each client's local SGD per round")
    lr: float = opt(0.02, low=0.0, low_open=True,
                    help="classification methods: learning rate of the clients' local SGD (momentum 0.9)")
    batch_size: int = opt(16, low=1, help="minibatch of the clients' local SGD (and of DCFM-B's student distillation)")
    device: str = opt("auto", help="auto (CUDA when available), cpu, cuda, cuda:N")
    min_clients: int = opt(2, low=1, help="wait for this many nodes; a phase goes on while this many reply")
    fraction_train: float = opt(1.0, low=0.0, low_open=True, high=1.0,
                                help="round-based methods: share of the connected nodes Flower's FedAvg samples "
                                     "for each training round (at least min-clients)")
    fraction_evaluate: float = opt(1.0, low=0.0, high=1.0,
                                   help="round-based classification methods: share of the connected nodes each "
                                        "round's federated evaluation asks (at least min-clients; 0: none, the "
                                        "server's global test set only)")
    evaluate_every: int = opt(1, low=1, help="round-based classification methods: federated evaluation in every "
                                             "N-th round and the last (1: every round; num-server-rounds: the "
                                             "last only, the per-client accuracy without a model download a round)")
    prior: str = opt("tiny", help="diffusion prior: tiny, a HF id or a local folder")
    round_timeout: float = opt(3600.0, low=0.0, low_open=True,
                               help="seconds the server waits for the replies of one round or phase")
    node_timeout: float = opt(600.0, low=0.0, low_open=True, help="seconds the server waits for min-clients nodes")
    resume: str = opt("", help="a round-based run's folder to continue from its last checkpoint ('' = a new run)")
    max_upload_mb: float = opt(512.0, low=0.0, low_open=True, help="uploads larger than this are dropped")
    aggregation: str = opt("mean", choices=("mean", "median", "trimmed-mean", "krum"),
                           help="FedAvg family: Flower's aggregation of the valid uploads (FedAvg, FedMedian, "
                                "FedTrimmedAvg, Krum)")
    server_epochs: int = opt(30, low=1, help="epochs of server-side training (one-shot methods)")


@dataclass(frozen=True)
class LogOptions:
    """`log.*`: what a run writes besides config.json, metrics.jsonl and summary.json."""

    tensorboard: bool = opt(False, help="also write TensorBoard event files of metrics.jsonl's rows into the run "
                                        "folder (`tensorboard --logdir <out-dir>`)")
    uploads: bool = opt(False, help="also keep each client's last reply with arrays per phase, and the message it "
                                    "answered, under <run dir>/uploads/ (what the privacy audit attacks: "
                                    "python -m experiments privacy-audit)")


# The app's own namespaces, beside the methods' (fedapp.registry): every run has them.
APP_NAMESPACES: dict[str, type] = {"log": LogOptions}


T = TypeVar("T")
Opts = TypeVar("Opts")  # the method's options dataclass (None for a method without options)


class _Common(Generic[T]):
    """A common key read through the run config (`cfg.seed` is `cfg.common.seed`), typed as CommonConfig
    declares it."""

    def __init__(self, read: Callable[[CommonConfig], T]) -> None:
        self.read = read

    @overload
    def __get__(self, cfg: None, owner: type) -> _Common[T]: ...
    @overload
    def __get__(self, cfg: RunConfig[Any], owner: type) -> T: ...

    def __get__(self, cfg: RunConfig[Any] | None, owner: type) -> _Common[T] | T:
        return self if cfg is None else self.read(cfg.common)


@dataclass(frozen=True)
class RunConfig(Generic[Opts]):
    """A validated run: the common keys, the partitioner's parameters, the method's contract (`spec`) and its
    options (`options`: a strategy or client annotates `RunConfig[ItsOptions]` and reads them typed)."""

    common: CommonConfig
    spec: MethodSpec
    partitioner_params: dict[str, Any]
    options: Opts
    namespace_values: dict[str, dict[str, Any]] = field(default_factory=dict)  # the method's and the app's
    log: LogOptions = field(default_factory=LogOptions)

    # the common keys, read through (image-size and classifier-size are resolved below)
    method = _Common(lambda c: c.method)
    dataset = _Common(lambda c: c.dataset)
    partitioner = _Common(lambda c: c.partitioner)
    seed = _Common(lambda c: c.seed)
    out_dir = _Common(lambda c: c.out_dir)
    run_name = _Common(lambda c: c.run_name)
    model = _Common(lambda c: c.model)
    num_server_rounds = _Common(lambda c: c.num_server_rounds)
    local_epochs = _Common(lambda c: c.local_epochs)
    lr = _Common(lambda c: c.lr)
    batch_size = _Common(lambda c: c.batch_size)
    device = _Common(lambda c: c.device)
    min_clients = _Common(lambda c: c.min_clients)
    fraction_train = _Common(lambda c: c.fraction_train)
    fraction_evaluate = _Common(lambda c: c.fraction_evaluate)
    evaluate_every = _Common(lambda c: c.evaluate_every)
    prior = _Common(lambda c: c.prior)
    round_timeout = _Common(lambda c: c.round_timeout)
    node_timeout = _Common(lambda c: c.node_timeout)
    resume = _Common(lambda c: c.resume)
    max_upload_mb = _Common(lambda c: c.max_upload_mb)
    aggregation = _Common(lambda c: c.aggregation)
    server_epochs = _Common(lambda c: c.server_epochs)

    @property
    def max_upload_bytes(self) -> int:
        """max-upload-mb in bytes: the cap every upload validator applies."""
        return int(self.common.max_upload_mb * 2**20)

    @property
    def image_size(self) -> int:
        """Pixels per side: the explicit value, or for "auto" the prior's (methods with a prior) or the
        dataset's native size (fedapp.geometry; fedapp.preflight refuses an explicit value the prior contradicts)."""
        if isinstance(self.common.image_size, int):  # else "auto"
            return self.common.image_size
        if "_image_size" not in self.__dict__:
            from fedapp.geometry import auto_image_size

            try:
                size = auto_image_size(self.spec.uses_prior, self.prior, self.dataset)
            except (ValueError, OSError) as err:
                raise ConfigError(f"prior={self.prior!r}: cannot read its image geometry "
                                  f"({str(err).splitlines()[0]})") from None
            object.__setattr__(self, "_image_size", size)
        return self.__dict__["_image_size"]

    @property
    def classifier_size(self) -> int:
        """The classifier's input size: the explicit value, or image-size for "auto"."""
        size = self.common.classifier_size
        return size if isinstance(size, int) else self.image_size  # "auto": image-size

    @property
    def resolved_run_name(self) -> str:
        if self.common.resume:  # a resumed run writes into its own folder
            return Path(self.common.resume).name
        if self.common.run_name:
            return self.common.run_name
        stamp = time.strftime("%Y%m%d-%H%M%S")
        # a hub id or a folder path names its dataset by its last part: the run folder stays one plain name
        dataset = re.sub(r"[^\w.-]+", "_", Path(self.dataset.rstrip("/")).name) or "dataset"
        return f"{self.method}-{dataset}-{self.partitioner}-s{self.seed}-{stamp}"

    def flat(self) -> dict[str, Any]:
        """Resolved flat config: what config.json records and messages carry (no other method's keys)."""
        out = option_values(self.common)
        out["image-size"] = self.image_size
        out["classifier-size"] = self.classifier_size
        out.update({f"partitioner.{k}": v for k, v in self.partitioner_params.items()})
        for ns, values in self.namespace_values.items():
            out.update({f"{ns}.{k}": v for k, v in values.items()})
        return out

    def torch_device(self) -> str:
        import torch

        if self.device == "auto":
            if ray_gpu_ids() == []:  # a Ray actor given no GPU (fedapp sets RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0,
                return "cpu"         # so Ray no longer hides the GPUs from it)
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


def ray_gpu_ids() -> list | None:
    """The GPUs Ray assigned to this process when it is a Ray worker (a ClientApp actor), else None."""
    ray = sys.modules.get("ray")  # never import Ray here: most processes have nothing to do with it
    is_initialized = getattr(ray, "is_initialized", None)  # absent while another thread is still importing it
    if ray is None or is_initialized is None or not is_initialized():
        return None
    ctx = ray.get_runtime_context()
    if ctx.worker.mode != ray.WORKER_MODE:  # the driver (the ServerApp in a simulation): no assignment
        return None
    return list(ctx.get_accelerator_ids().get("GPU", []))


def _check_device(value: str) -> None:
    ok = value in ("auto", "cpu", "cuda") or (
        value.startswith("cuda:") and value[5:].isdigit()
    )
    if not ok:
        raise refuse("device", value, "must be auto, cpu, cuda or cuda:N")


def _check_run_name(value: str) -> None:
    """The run folder must stay inside out-dir: one plain folder name."""
    if value and (value in (".", "..") or "/" in value or "\\" in value or value.startswith("~")):
        raise refuse("run-name", value, "must be a plain folder name (no '/', '\\', '..' or '~'); "
                                        "results land in <out-dir>/<run-name>/")


def _partitioner_params(partitioner: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """Typed params of the chosen partitioner; every parameter given is checked, but those of other
    partitioners (pyproject.toml lists every partitioner's defaults) are not kept."""
    checked = resolve(PARAMS, given, prefix="partitioner.")
    return {key: checked[key] for key in PARTITIONER_PARAMS[partitioner]}


def normalize_keys(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The Python API may say `partitioner` for `partitioner.name`."""
    flat = dict(flat)
    if "partitioner" in flat:
        value = flat.pop("partitioner")
        if flat.get(PARTITIONER_KEY, value) != value:
            raise ConfigError(f"partitioner={value!r} contradicts {PARTITIONER_KEY}={flat[PARTITIONER_KEY]!r}")
        flat[PARTITIONER_KEY] = value
    return flat


def parse_run_config(flat: Mapping[str, Any]) -> RunConfig[Any]:
    """Validate a flat run config (from pyproject/`--run-config`, `fedapp.simulate` or a message's record,
    which lacks other methods' namespaces) against fedapp.registry.METHODS."""
    from fedapp import registry

    flat = normalize_keys(flat)
    spaces_known = registry.namespaces() + list(APP_NAMESPACES)
    common_keys = set(flat_defaults(CommonConfig))
    common: dict[str, Any] = {}
    part: dict[str, Any] = {}
    spaces: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key in common_keys:
            common[key] = value
        elif key.startswith("partitioner."):
            part[key[len("partitioner."):]] = value
        elif "." in key and key.split(".", 1)[0] in spaces_known:
            ns, sub = key.split(".", 1)
            spaces.setdefault(ns, {})[sub] = value
        else:
            allowed = ", ".join(sorted(common_keys)) + ", partitioner.*, " + ", ".join(
                f"{ns}.*" for ns in spaces_known)
            raise refuse(key, value, f"unknown key; allowed: {allowed}")

    cc = build_options(CommonConfig, common)
    Rule(str, choices=tuple(registry.METHODS)).check("method", cc.method)  # methods may be registered at run time
    _check_device(cc.device)
    _check_run_name(cc.run_name)
    params = _partitioner_params(cc.partitioner, part)

    # Validate every namespace given (pyproject lists them all); keep the chosen method's and the app's:
    # the run reads no other, and its config.json and messages (flat()) carry no other.
    spec = registry.METHODS[cc.method]
    kept = ([spec.namespace] if spec.namespace else []) + list(APP_NAMESPACES)
    objs: dict[str, Any] = {}
    for ns in spaces_known:
        if ns in spaces or ns in kept:
            cls = APP_NAMESPACES.get(ns) or registry.options_class(ns)
            objs[ns] = build_options(cls, spaces.get(ns, {}), prefix=f"{ns}.")
    return RunConfig(common=cc, spec=spec, partitioner_params=params, options=objs.get(spec.namespace or ""),
                     namespace_values={ns: option_values(objs[ns]) for ns in kept}, log=objs["log"])


def method_scoped(flat: Mapping[str, Any], method: str) -> dict[str, Any]:
    """`flat` without other methods' namespaces: what a run of `method` keeps (a config.json written
    before runs were scoped lists every method's keys)."""
    from fedapp import registry

    own = registry.METHODS[method].namespace if method in registry.METHODS else None
    others = set(registry.namespaces()) - {own}
    return {k: v for k, v in flat.items() if not ("." in k and k.split(".", 1)[0] in others)}


def check_data(cfg: RunConfig[Any], num_clients: int) -> None:
    """The dataset-dependent checks (domain partitioner needs domains, ...): feddata's, raising ConfigError."""
    from feddata import validate

    validate(cfg.dataset, cfg.partitioner, cfg.partitioner_params, num_clients, seed=cfg.seed,
             image_size=cfg.image_size)


def all_defaults() -> dict[str, Any]:
    """Every key with its default: the `[tool.flwr.app.config]` block of pyproject.toml."""
    from fedapp import registry

    out = flat_defaults(CommonConfig)
    out.update({f"partitioner.{key}": rule.default for key, rule in PARAMS.items()})
    for ns in registry.namespaces():
        out.update(flat_defaults(registry.options_class(ns), prefix=f"{ns}."))
    for ns, cls in APP_NAMESPACES.items():
        out.update(flat_defaults(cls, prefix=f"{ns}."))
    return out


def toml_block() -> str:
    """`[tool.flwr.app.config]` for pyproject.toml, generated from the dataclasses."""
    import json

    lines = ["[tool.flwr.app.config]"]
    for key, value in all_defaults().items():
        text = json.dumps(value) if not isinstance(value, bool) else str(value).lower()
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def write_pyproject(path: str = "pyproject.toml") -> None:
    """Replace the `[tool.flwr.app.config]` block (the file's last table) with `toml_block()`."""
    p = Path(path)
    text = p.read_text()
    head = text[: text.index("[tool.flwr.app.config]")]
    p.write_text(head + toml_block())


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m fedapp.config",
                                 description="The [tool.flwr.app.config] block every option's default makes.")
    ap.add_argument("--write", action="store_true", help="replace it in pyproject.toml (after adding or changing "
                                                         "an option); else print it")
    if ap.parse_args(argv).write:
        write_pyproject()
    else:
        print(toml_block(), end="")


if __name__ == "__main__":
    main()
