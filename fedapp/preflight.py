"""What a run needs from the machine it starts on, checked before Ray or any client starts.

fedapp.config checks that every value is well-formed; this module checks that the values work
here: the data fits the federation, min-clients does not exceed its nodes, out-dir is a writable
folder, and the dataset, the prior and the classifier named resolve (a built-in, an existing folder, or a
hub id that is cached or reachable: offline, an uncached id fails in one line at once, not after the hub
client's retries). Each failure is one ConfigError line naming key, value and what is
allowed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fedapp.config import RunConfig, check_data, method_scoped, parse_run_config
from fedapp.options import AUTO, ConfigError, refuse

BUILTIN_MODELS = ("cnn", "cnn-gap", "resnet10", "resnet18")  # fedapp.models.classifier.CNNS, RESNET_DEPTHS


def check_out_dir(cfg: RunConfig) -> None:
    root = Path(cfg.out_dir).expanduser()
    if root.exists() and not root.is_dir():
        raise refuse("out-dir", cfg.out_dir, "is a file; must be a folder results can be written to")
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as err:
        raise refuse("out-dir", cfg.out_dir, f"not writable ({err.strerror or err}); "
                                             "must be a folder results can be written to") from None


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def hub_cached(repo_id: str, filename: str) -> bool:
    """Whether `filename` of `repo_id` is in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, filename), str)
    except Exception:  # a malformed id: not cached
        return False


def hub_reachable(timeout: float = 1.5) -> bool:
    """Whether the Hugging Face endpoint answers an HTTP request within `timeout` seconds (any status): on an
    offline machine the hub client would otherwise retry for ~30 s before its error. An HTTP answer, not a TCP
    connect, since some networks accept every connect and never reply."""
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    url = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        return True
    except urllib.error.HTTPError:  # an answer, if not a 200
        return True
    except (OSError, ValueError):  # refused, unresolved, timed out, TLS failed, malformed endpoint
        return False


def hub_down() -> str | None:
    """Why nothing can be fetched from the hub here (switched off, or unreachable), else None."""
    if hub_offline():
        return "HF_HUB_OFFLINE is set"
    return None if hub_reachable() else "the hub is unreachable"


def hub_missing(repo_id: str, filename: str) -> str | None:
    """Why a hub id cannot load here (not cached, and the hub is switched off or unreachable), else None."""
    if hub_cached(repo_id, filename):
        return None
    why = hub_down()
    return f"not in the local Hugging Face cache and {why}" if why else None


def check_dataset(cfg: RunConfig) -> None:
    """A hub dataset (an id, or an alias such as cifar10) is cached or the hub answers; built-ins and folders
    are feddata's to check. Before feddata loads anything: `datasets` would retry the hub for ~25 s."""
    from feddata.hub import hub_dataset_cached, hub_dataset_id

    repo = hub_dataset_id(cfg.dataset)
    if repo is None or hub_dataset_cached(repo):
        return
    why = hub_down()
    if why:
        raise refuse("dataset", cfg.dataset, f"not in the local Hugging Face cache and {why}; allowed: a "
                                             "built-in name, a folder, or a hub dataset id that is cached or "
                                             "reachable")


def check_prior(cfg: RunConfig) -> None:
    """The prior resolves: `tiny` (built on first use), an SD-layout folder, or a cached/reachable hub id."""
    from fedapp.models.prior import resolve_prior

    try:
        src = resolve_prior(cfg.prior, cfg.dataset)
    except ValueError as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    why = hub_missing(src.location, "model_index.json") if src.kind == "hub" else None
    if why:
        raise refuse("prior", cfg.prior, f"{why}; allowed: 'tiny', an SD-1.5-layout folder, or a hub id that is "
                                         "cached or reachable")


def check_model(cfg: RunConfig) -> None:
    """The classifier: a built-in, a transformers folder with config.json, or a cached/reachable hub id."""
    name = cfg.model
    if name in BUILTIN_MODELS:
        return
    path = Path(name).expanduser()
    allowed = f"allowed: {', '.join(BUILTIN_MODELS)}, a transformers ResNet folder or hub id"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise refuse("model", name, f"folder has no config.json; {allowed}")
        return
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise refuse("model", name, f"no such folder and not a hub id; {allowed}")
    why = hub_missing(name, "config.json")
    if why:
        raise refuse("model", name, f"{why}; {allowed}")


def check_image_size(cfg: RunConfig) -> None:
    """An explicit image-size must be the prior's: the prior decides the geometry."""
    explicit = cfg.common.image_size
    if explicit != AUTO and cfg.spec.uses_prior:
        from fedapp.models.prior import prior_image_size

        size = prior_image_size(cfg.prior, cfg.dataset)
        if explicit != size:
            raise refuse("image-size", explicit, f"prior={cfg.prior!r} makes {size}x{size} images; "
                                                 f"must be 'auto' or {size}")


def check_protocol(cfg: RunConfig) -> None:
    """A method's own machine-dependent check (MethodSpec.preflight: `cfg -> reason | None`), e.g.
    FedDifRC's up-blocks against the prior's decoder."""
    from fedapp import registry

    check = registry.preflight_check(cfg.method)
    reason = check(cfg) if check is not None else None
    if reason is not None:
        raise ConfigError(reason)


def check_fraction_train(cfg: RunConfig) -> None:
    """Client sampling is Flower FedAvg's: only the strategies on its round loop honour it
    (MethodSpec.samples_clients)."""
    from fedapp import registry

    for key, value, does in (("fraction-train", cfg.fraction_train, "trains"),
                             ("fraction-evaluate", cfg.fraction_evaluate, "evaluates")):
        if value < 1.0 and not cfg.spec.samples_clients:
            samplers = ", ".join(registry.names(lambda s: s.samples_clients))
            raise refuse(key, value, f"method={cfg.method!r} {does} every client; must be 1.0, or pick a "
                                     f"method that samples clients ({samplers})")


def check_nodes(cfg: RunConfig, num_nodes: int) -> None:
    if cfg.min_clients > num_nodes:
        raise refuse("min-clients", cfg.min_clients, f"must be <= the federation's {num_nodes} nodes")


def sample_size_problem(cfg: RunConfig, num_nodes: int) -> str | None:
    """Why a fraction below 1 would not apply on `num_nodes` nodes, or None. Flower's FedAvg samples
    max(int(nodes x fraction), min-clients), so a smaller share is silently replaced by min-clients
    (min-clients = nodes made a 0.5 run train every node every round, as it once did in the leaderboard)."""
    if not cfg.spec.samples_clients:
        return None
    for key, value in (("fraction-train", cfg.fraction_train), ("fraction-evaluate", cfg.fraction_evaluate)):
        sampled = int(num_nodes * value)
        if 0.0 < value < 1.0 and sampled < cfg.min_clients:
            return (f"{key}={value}: samples int({num_nodes} x {value}) = {sampled} of the federation's {num_nodes} "
                    f"nodes, fewer than min-clients={cfg.min_clients}, which Flower's FedAvg would sample instead; "
                    f"must be >= {cfg.min_clients}/{num_nodes}"
                    + (f", or lower min-clients to <= {sampled}" if sampled else ""))
    return None


def check_sample_size(cfg: RunConfig, num_nodes: int) -> None:
    """A simulation's federation is known before it starts: a fraction that would not apply is refused."""
    if (why := sample_size_problem(cfg, num_nodes)) is not None:
        raise ConfigError(why)


# Keys a resumed run may change: where it writes and that it resumes.
RESUME_FREE_KEYS = ("resume", "run-name", "out-dir", "log.tensorboard")  # where and what it logs, not what it computes


def saved_config(recorded: dict, method: str) -> dict:
    """A run folder's config.json as today's code reads it: scoped to its method (as flat() is), and a key
    added since the run was saved takes its default, so such a run still resumes where this run leaves
    the new key at its default. A record today's parser refuses is compared as written."""
    scoped = method_scoped(recorded, method)
    try:
        return {**parse_run_config(scoped).flat(), **scoped}
    except ConfigError:
        return scoped


def check_resume(cfg: RunConfig) -> None:
    """`resume` names a folder of a resumable method's run with a checkpoint, run with this config."""
    import json

    from fedapp import registry
    from fedapp.server.checkpoint import CHECKPOINT, CHECKPOINT_META

    folder = Path(cfg.resume).expanduser()
    if not cfg.spec.resumable:
        raise refuse("resume", cfg.resume, f"method={cfg.method!r} is not resumable; allowed for the "
                                           f"resumable methods ({', '.join(registry.names(lambda s: s.resumable))})")
    if not all((folder / f).is_file() for f in ("config.json", CHECKPOINT, CHECKPOINT_META)):
        raise refuse("resume", cfg.resume, "not a run folder with config.json and a checkpoint; "
                                           "must be the folder of a run that completed at least one round")
    saved = saved_config(json.loads((folder / "config.json").read_text()), cfg.method)
    now = cfg.flat()
    differ = sorted(k for k in set(saved) | set(now) if k not in RESUME_FREE_KEYS and saved.get(k) != now.get(k))
    if differ:
        k = differ[0]
        raise refuse("resume", cfg.resume, f"the run config differs in {k} ({now.get(k)!r} here, "
                                           f"{saved.get(k)!r} in the run); must equal the resumed run's config")


def preflight(cfg: RunConfig, num_nodes: int | None = None) -> None:
    """Every machine-dependent check; `num_nodes` where the federation's size is known."""
    if cfg.resume:
        check_resume(cfg)
    else:
        check_out_dir(cfg)
    check_dataset(cfg)
    if cfg.spec.uses_prior:
        check_prior(cfg)
        check_image_size(cfg)
    check_protocol(cfg)
    check_fraction_train(cfg)
    check_model(cfg)
    if num_nodes is not None:
        check_nodes(cfg, num_nodes)
        check_sample_size(cfg, num_nodes)
        check_data(cfg, num_nodes)
