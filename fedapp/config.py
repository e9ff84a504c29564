"""The run config: typed dataclasses, validated before anything heavy starts.

Flower hands the app a flat dict (`context.run_config`, keys like `num-server-rounds`,
`partitioner.alpha`, `espresso.clusters`). `parse_run_config` turns it into a `RunConfig`
and raises one `ConfigError` line naming the key, the value and what is allowed.

Method options live in each method's protocol module (fedapp/protocols/<m>.py: a dataclass whose
fields carry `opt(...)` metadata); the method's MethodSpec (fedapp.registry) names it and its namespace.
A run keeps, and sends its clients, the common keys, the app's namespaces and its method's namespace only.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from fedapp.options import (AUTO, PARTITIONER_KEY, ConfigError, build_options, check_value,  # noqa: F401 (re-exported)
                            flat_defaults, key_of, opt, option_values)


@dataclass(frozen=True)
class CommonConfig:
    """Keys every method shares. Flower's own key for rounds is `num-server-rounds`."""

    method: str = opt("espresso", help="which method/baseline runs (see fedapp.registry)")
    dataset: str = opt("digit-styles", help="built-in source, hub id or local folder")
    partitioner: str = opt("domain", help="how the client pool is split")
    seed: int = opt(0, low=0, help="seeds every draw: the partition, client training, server sampling and evaluation")
    out_dir: str = opt("runs", help="results land in <out-dir>/<run-name>/")
    run_name: str = opt("", help="empty: <method>-<dataset>-<partitioner>-s<seed>-<time>")
    model: str = opt("cnn", help="classifier: cnn (cnn-gap: the recipe before docs/recipe.md), resnet10, resnet18, "
                                 "or a transformers ResNet id/folder")
    image_size: int | str = opt(AUTO, auto=True, low=8, high=512,
                                help="pixels per side; auto: the prior's size for methods with a prior, else the "
                                     "dataset's native size")
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


# The app's own namespaces, beside the methods' (fedapp.registry): every run has them.
APP_NAMESPACES: dict[str, type] = {"log": LogOptions}


@dataclass(frozen=True)
class RunConfig:
    common: CommonConfig
    spec: Any  # the chosen method's fedapp.registry.MethodSpec: its contract (namespace, traits)
    partitioner_params: dict[str, Any]
    options: Any  # the chosen method's options dataclass (or None)
    namespace_values: dict[str, dict[str, Any]] = field(default_factory=dict)  # the method's and the app's
    log: LogOptions = field(default_factory=LogOptions)

    def __getattr__(self, name: str) -> Any:  # cfg.seed, cfg.method, ...
        return getattr(self.common, name)

    @property
    def max_upload_bytes(self) -> int:
        """max-upload-mb in bytes: the cap every upload validator applies."""
        return int(self.common.max_upload_mb * 2**20)

    @property
    def image_size(self) -> int:
        """Pixels per side: the explicit value, or for "auto" the prior's (methods with a prior) or the
        dataset's native size (fedapp.geometry; fedapp.preflight refuses an explicit value the prior contradicts)."""
        if self.common.image_size != AUTO:
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
    if is_initialized is None or not is_initialized():
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
        raise ConfigError(f"device={value!r}: must be auto, cpu, cuda or cuda:N")


def _check_run_name(value: str) -> None:
    """The run folder must stay inside out-dir: one plain folder name."""
    if value and (value in (".", "..") or "/" in value or "\\" in value or value.startswith("~")):
        raise ConfigError(f"run-name={value!r}: must be a plain folder name (no '/', '\\', '..' or '~'); "
                          "results land in <out-dir>/<run-name>/")


def _partitioner_params(partitioner: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """Typed params of the chosen partitioner; keys of other partitioners are tolerated
    (pyproject.toml lists every partitioner's defaults) but not used."""
    from feddata import PARTITIONER_PARAMS, resolve_params

    known = {k for spec in PARTITIONER_PARAMS.values() for k in spec}
    for key, value in given.items():
        if key not in known:
            allowed = ", ".join(sorted(f"partitioner.{k}" for k in known))
            raise ConfigError(f"partitioner.{key}={value!r}: unknown key; allowed: {allowed}")
    spec = PARTITIONER_PARAMS[partitioner]
    try:
        return resolve_params(partitioner, {k: v for k, v in given.items() if k in spec})
    except ValueError as err:
        raise ConfigError(str(err)) from None


def normalize_keys(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The Python API may say `partitioner` for `partitioner.name`."""
    flat = dict(flat)
    if "partitioner" in flat:
        value = flat.pop("partitioner")
        if flat.get(PARTITIONER_KEY, value) != value:
            raise ConfigError(f"partitioner={value!r} contradicts {PARTITIONER_KEY}={flat[PARTITIONER_KEY]!r}")
        flat[PARTITIONER_KEY] = value
    return flat


def parse_run_config(flat: Mapping[str, Any]) -> RunConfig:
    """Validate a flat run config (from pyproject/`--run-config`, `fedapp.simulate` or a message's record,
    which lacks other methods' namespaces) against fedapp.registry.METHODS."""
    from feddata import PARTITIONERS

    from fedapp import registry

    flat = normalize_keys(flat)
    spaces_known = registry.namespaces() + list(APP_NAMESPACES)
    common_keys = set(flat_defaults(CommonConfig))
    common, part, spaces = {}, {}, {}
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
            raise ConfigError(f"{key}={value!r}: unknown key; allowed: {allowed}")

    cc = build_options(CommonConfig, common)
    if cc.method not in registry.METHODS:
        raise ConfigError(f"method={cc.method!r}: must be one of {', '.join(registry.METHODS)}")
    if cc.partitioner not in PARTITIONERS:
        raise ConfigError(f"{PARTITIONER_KEY}={cc.partitioner!r}: must be one of {', '.join(PARTITIONERS)}")
    _check_device(cc.device)
    _check_run_name(cc.run_name)
    params = _partitioner_params(cc.partitioner, part)

    # Validate every namespace given (pyproject lists them all); keep the chosen method's and the app's:
    # the run reads no other, and its config.json and messages (flat()) carry no other.
    spec = registry.METHODS[cc.method]
    kept = ([spec.namespace] if spec.namespace else []) + list(APP_NAMESPACES)
    objs = {}
    for ns in spaces_known:
        if ns in spaces or ns in kept:
            cls = APP_NAMESPACES.get(ns) or registry.options_class(ns)
            objs[ns] = build_options(cls, spaces.get(ns, {}), prefix=f"{ns}.")
    return RunConfig(common=cc, spec=spec, partitioner_params=params, options=objs.get(spec.namespace),
                     namespace_values={ns: option_values(objs[ns]) for ns in kept}, log=objs["log"])


def method_scoped(flat: Mapping[str, Any], method: str) -> dict[str, Any]:
    """`flat` without other methods' namespaces: what a run of `method` keeps (a config.json written
    before runs were scoped lists every method's keys)."""
    from fedapp import registry

    own = registry.METHODS[method].namespace if method in registry.METHODS else None
    others = set(registry.namespaces()) - {own}
    return {k: v for k, v in flat.items() if not ("." in k and k.split(".", 1)[0] in others)}


def check_data(cfg: RunConfig, num_clients: int) -> None:
    """The dataset-dependent checks (domain partitioner needs domains, ...), as ConfigError."""
    from feddata import validate

    try:
        validate(cfg.dataset, cfg.partitioner, cfg.partitioner_params, num_clients,
                 seed=cfg.seed, image_size=cfg.image_size)
    except ValueError as err:
        raise ConfigError(str(err)) from None


# The default experiment (Espresso on digit-styles, one domain per client, 16 training images per
# class per client) caps clients through the app's defaults; feddata's own default stays "no cap",
# so loading data from Python is unchanged.
DEFAULT_PARTITIONER_PARAMS = {"per-class": 16}


def all_defaults() -> dict[str, Any]:
    """Every key with its default: the `[tool.flwr.app.config]` block of pyproject.toml."""
    from feddata import PARTITIONER_PARAMS

    from fedapp import registry

    out = flat_defaults(CommonConfig)
    for spec in PARTITIONER_PARAMS.values():
        for key, (_, default) in spec.items():
            out.setdefault(f"partitioner.{key}", DEFAULT_PARTITIONER_PARAMS.get(key, default))
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
