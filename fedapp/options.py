"""Options on the ground floor: how a config field declares its allowed values (`opt`), how a flat
`{key: value}` becomes a typed options dataclass (`build_options`, `check_value`), its defaults as flat
keys (`flat_defaults`), and the one error a bad value raises (`ConfigError`). It imports nothing of
fedapp, so that every layer above — fedapp/config.py, the method protocols, the registry — can use it
without an import loop (config -> registry -> protocols -> config before it existed).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any, Mapping


class ConfigError(ValueError):
    """A user error in the run config: one line naming key, value and what is allowed."""


AUTO = "auto"  # a value derived from the run's components (image-size: from the prior or the dataset)


def opt(default: Any, *, choices: tuple | None = None, low: float | None = None,
        high: float | None = None, low_open: bool = False, auto: bool = False, help: str = "") -> Any:
    """A config field with its allowed values (checked by `check_value`); `auto` also admits "auto"."""
    return field(default=default, metadata={
        "choices": choices, "low": low, "high": high, "low_open": low_open, "auto": auto, "help": help,
    })


# TOML (and so Flower's run config) cannot hold both `partitioner = "iid"` and
# `partitioner.alpha = 0.5`, so the partitioner is chosen with `partitioner.name`.
PARTITIONER_KEY = "partitioner.name"


def key_of(name: str) -> str:
    """Python field name -> config key (`num_server_rounds` -> `num-server-rounds`)."""
    return PARTITIONER_KEY if name == "partitioner" else name.replace("_", "-")


def _coerce(key: str, value: Any, typ: type) -> Any:
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):
        raise ConfigError(f"{key}={value!r}: must be of type {typ.__name__}")
    if typ is float and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r}: must be a finite number")
    return value


def check_value(key: str, value: Any, typ: type, meta: Mapping[str, Any]) -> Any:
    """Coerce `value` to `typ` and check it against the field's choices/range."""
    if meta.get("auto") and value == AUTO:
        return value
    try:
        value = _coerce(key, value, typ)
    except ConfigError:
        if meta.get("auto"):
            raise ConfigError(f"{key}={value!r}: must be {AUTO!r} or of type {typ.__name__}") from None
        raise
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{key}={value!r}: must be one of {allowed}")
    low, high = meta.get("low"), meta.get("high")
    if low is not None:
        if meta.get("low_open") and not value > low:
            raise ConfigError(f"{key}={value!r}: must be > {low}")
        if not meta.get("low_open") and not value >= low:
            raise ConfigError(f"{key}={value!r}: must be >= {low}")
    if high is not None and not value <= high:
        raise ConfigError(f"{key}={value!r}: must be <= {high}")
    return value


def _field_types(cls: type) -> dict[str, tuple[type, Mapping[str, Any]]]:
    hints = {f.name: f for f in dataclasses.fields(cls)}
    types = {"int": int, "float": float, "str": str, "bool": bool}
    out = {}
    for name, f in hints.items():
        if f.metadata.get("skip"):
            continue
        if f.metadata.get("auto"):  # declared `int | str` / `float | str`: the scalar type, or "auto"
            typ = types[str(f.type).split("|")[0].strip()]
        else:
            typ = f.type if isinstance(f.type, type) else types[str(f.type)]
        out[name] = (typ, f.metadata)
    return out


def build_options(cls: type, values: Mapping[str, Any], prefix: str = "") -> Any:
    """Instantiate an options dataclass from flat `{key: value}` (keys without prefix)."""
    fields = _field_types(cls)
    by_key = {key_of(name): name for name in fields}
    kwargs = {}
    for key, value in values.items():
        if key not in by_key:
            allowed = ", ".join(sorted(prefix + k for k in by_key)) or "(none)"
            raise ConfigError(f"{prefix}{key}={value!r}: unknown key; allowed: {allowed}")
        name = by_key[key]
        typ, meta = fields[name]
        kwargs[name] = check_value(prefix + key, value, typ, meta)
    return cls(**kwargs)


def flat_defaults(cls: type, prefix: str = "") -> dict[str, Any]:
    """The dataclass' defaults as flat config keys (what pyproject.toml must list)."""
    inst = cls()
    return {prefix + key_of(n): getattr(inst, n) for n in _field_types(cls)}


def option_values(obj: Any, prefix: str = "") -> dict[str, Any]:
    return {prefix + key_of(n): getattr(obj, n) for n in _field_types(type(obj))}
