"""Options on the ground floor: a config field declares what it allows with `opt(...)` (or `declared(rule)`
for a rule declared elsewhere, e.g. feddata's), a flat `{key: value}` becomes a typed options dataclass
(`build_options`), and its defaults and values read back as flat keys (`flat_defaults`, `option_values`).
What a field allows is a feddata.validation Rule, checked by `Rule.check`, the check the partitioners'
parameters and the data calls' arguments pass too, raising the same `ConfigError` line. It imports nothing
of fedapp, so that every layer above (fedapp/config.py, the method protocols, the registry) can use it
without an import loop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, NamedTuple

from feddata.validation import AUTO, ConfigError, Rule, refusal, refuse, resolve  # noqa: F401 (re-exported)

# TOML (and so Flower's run config) cannot hold both `partitioner = "iid"` and
# `partitioner.alpha = 0.5`, so the partitioner is chosen with `partitioner.name`.
PARTITIONER_KEY = "partitioner.name"
_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def declared(rule: Rule, *, key: str | None = None, help: str | None = None) -> Any:
    """A config field that allows what `rule` allows (its default, and its help unless `help` is given);
    `key`: its config key, when not the field's name with '-' for '_'."""
    if help is not None:
        rule = dataclasses.replace(rule, help=help)
    return field(default=rule.default, metadata={"rule": rule, "key": key})


def opt(default: Any, *, choices: tuple | None = None, low: float | None = None, high: float | None = None,
        low_open: bool = False, auto: bool = False, key: str | None = None, help: str = "") -> Any:
    """A config field with its allowed values; `auto` also admits "auto". Its type is the annotation's."""
    rule = Rule(object, default, choices=choices, low=low, high=high, low_open=low_open, auto=auto, help=help)
    return declared(rule, key=key)


class Option(NamedTuple):
    name: str  # the dataclass field
    rule: Rule


def options_of(cls: type) -> dict[str, Option]:
    """Config key -> (field name, rule typed as the field is annotated) of an options dataclass."""
    out = {}
    for f in dataclasses.fields(cls):
        if "rule" not in f.metadata:
            continue
        rule = f.metadata["rule"]
        # `int | str` / `float | str` with auto: the scalar type, or "auto"
        typ = f.type if isinstance(f.type, type) else _TYPES[str(f.type).split("|")[0].strip()]
        out[f.metadata["key"] or f.name.replace("_", "-")] = Option(f.name, dataclasses.replace(rule, type=typ))
    return out


def build_options(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    """Instantiate an options dataclass from flat `{key: value}` (keys without prefix), each value checked."""
    opts = options_of(cls)
    checked = resolve({k: o.rule for k, o in opts.items()}, values, prefix)
    return cls(**{opts[k].name: v for k, v in checked.items()})


def flat_defaults(cls: type, prefix: str = "") -> dict[str, Any]:
    """The dataclass' defaults as flat config keys (what pyproject.toml must list)."""
    return {prefix + k: o.rule.default for k, o in options_of(cls).items()}


def option_values(obj: Any, prefix: str = "") -> dict[str, Any]:
    return {prefix + k: getattr(obj, o.name) for k, o in options_of(type(obj)).items()}
