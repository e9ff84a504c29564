"""The planner's input: a preset TOML and/or `key=value` pairs, read as `flwr run --run-config` reads them
(a file's tables flattened to dotted keys, as Flower's parse_config_args does; pairs by its key=value pattern),
over every default
(fedapp.config.all_defaults) and parsed by fedapp.config.parse_run_config: the same keys, checks and
one-line ConfigErrors as a run.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Mapping

from fedapp.options import AUTO, ConfigError

APP_TABLE = "tool.flwr.app.config."  # a pyproject-style file nests the keys under this table


PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")  # Flower's key=value pattern (parse_config_args)


def read_run_config(items: list[str]) -> dict[str, Any]:
    """Flat keys from arguments: at most one .toml file (a preset) first, then `key=value` pairs over it.
    A value is read as TOML (5, 0.1, true, "text"), as `flwr run --run-config` reads it; one that is no TOML
    value is taken as a string, so `method=fedavg` needs no shell quoting."""
    files = [a for a in items if a.endswith(".toml")]
    if len(files) > 1:
        raise ConfigError(f"{' '.join(files)}: give one preset file (key=value pairs may follow it)")
    flat: dict[str, Any] = {}
    if files:
        path = Path(files[0]).expanduser()
        if not path.is_file():
            raise ConfigError(f"{files[0]}: no such preset file")
        try:
            flat.update(flatten(tomllib.loads(path.read_text())))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{files[0]}: not a TOML run config ({str(err).splitlines()[0]})") from None
    for item in (a for a in items if not a.endswith(".toml")):
        matches = PAIR.findall(item)
        if not matches:
            raise ConfigError(f"{item!r}: expected key=value (values as in TOML: 5, 0.1, true, \"text\") "
                              "or a preset .toml file")
        for key, raw in matches:
            try:
                flat[key] = tomllib.loads(f"v = {raw}")["v"]
            except tomllib.TOMLDecodeError:
                flat[key] = raw.strip("'\"")
    return {k[len(APP_TABLE):] if k.startswith(APP_TABLE) else k: v for k, v in flat.items()}


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested TOML tables as dotted keys ([espresso] steps = 50 -> espresso.steps), as Flower flattens them."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resolve(run_config: Mapping[str, Any]):
    """(RunConfig, PriorArch or None): the config over all defaults; for a method with a prior its
    architecture (fedapp.plan.arch, no weights, no network) and, for image-size = auto, the prior's size
    (so a hub id never has to be asked for its geometry)."""
    from fedapp.config import all_defaults, normalize_keys, parse_run_config
    from fedapp.plan.arch import prior_arch

    flat = {**all_defaults(), **normalize_keys(run_config)}
    cfg = parse_run_config(flat)
    arch = prior_arch(cfg.prior, cfg.dataset) if cfg.spec.uses_prior else None
    if arch is not None and cfg.common.image_size == AUTO:
        # what RunConfig.image_size caches once it has read the prior's configs (there: from the hub)
        object.__setattr__(cfg, "_image_size", arch.image_size)
    return cfg, arch
