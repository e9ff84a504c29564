"""One way to check a configuration value, for every entry point: the app's run-config options
(fedapp.options), the partitioners' parameters (feddata.partition), the data calls' own arguments
(feddata.api, feddata.sources) and the checks before a run (fedapp.preflight).

A `Rule` declares what a key allows (type, default, choices or range, an "auto" escape); `Rule.check(key,
value)` returns the value as its type or raises the one error all of them raise: `refuse(key, value,
allowed)`, a ConfigError of one line `key=value: what is allowed`, the value as Python writes it (strings
quoted). It lives at the bottom of the import graph (it imports nothing of feddata or fedapp), so that
feddata and every layer above can use it.

Types, one rule everywhere: an int key takes an integer only ("3", 2.0 and True are refused: a config that
writes them means something else, or nothing); a float key takes an integer or a float, finite; a bool key
takes true or false; a str key takes a string.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A user error in the run config: one line naming key, value and what is allowed."""


AUTO = "auto"  # a value derived from the run's components (image-size: from the prior or the dataset)


def refusal(key: str, value: Any, allowed: str) -> str:
    """The one format of a refusal: `key=value: what is allowed`."""
    return f"{key}={value!r}: {allowed}"


def refuse(key: str, value: Any, allowed: str) -> ConfigError:
    """The error a bad value raises: its refusal."""
    return ConfigError(refusal(key, value, allowed))


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _is_type(value: Any, typ: type) -> bool:
    if isinstance(value, bool) or typ is bool:  # bool is an int subclass: never a number here, nor a number a bool
        return typ is bool and isinstance(value, bool)
    if typ is int:
        return isinstance(value, numbers.Integral)
    if typ is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, typ)


@dataclass(frozen=True)
class Rule:
    """What a key allows. `low`/`high` bound a number (`low_open`/`high_open`: strictly); `auto` also admits
    "auto"; `reason` says why a bound is where it is (it ends the refusal)."""

    type: type
    default: Any = None
    choices: tuple | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    auto: bool = False
    reason: str = ""
    help: str = ""

    def allowed(self) -> str:
        """What the rule admits, as its refusal says it after "must be "."""
        if self.choices is not None:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        elif self.low is not None and self.high is not None:
            text = (f"in {'(' if self.low_open else '['}{_num(self.low)}, "
                    f"{_num(self.high)}{')' if self.high_open else ']'}")
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_num(self.low)}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {_num(self.high)}"
        else:
            text = f"of type {self.type.__name__}"
        return f"{AUTO!r} or {text}" if self.auto else text

    def _refuse(self, key: str, value: Any, allowed: str) -> ConfigError:
        return refuse(key, value, f"must be {allowed}" + (f" ({self.reason})" if self.reason else ""))

    def check(self, key: str, value: Any) -> Any:
        """`value` as the rule's type, or the refusal naming `key`, the value as given and what is allowed."""
        if self.auto and value == AUTO:
            return value
        if not _is_type(value, self.type):
            kind = f"of type {self.type.__name__}"
            raise self._refuse(key, value, f"{AUTO!r} or {kind}" if self.auto else kind)
        typed = self.type(value)
        if self.type is float and not math.isfinite(typed):
            raise self._refuse(key, value, "a finite number")
        if self.choices is not None and typed not in self.choices:
            raise self._refuse(key, value, self.allowed())
        below = self.low is not None and (typed <= self.low if self.low_open else typed < self.low)
        above = self.high is not None and (typed >= self.high if self.high_open else typed > self.high)
        if below or above:
            raise self._refuse(key, value, self.allowed())
        return typed


def resolve(rules: Mapping[str, Rule], given: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every key of `rules` with its checked value from `given` or its default; a key of `given` that no rule
    names is refused, listing those that exist. Keys are without `prefix`, messages name them with it."""
    for key, value in given.items():
        if key not in rules:
            allowed = ", ".join(prefix + k for k in sorted(rules)) or "(none)"
            raise refuse(prefix + key, value, f"unknown key; allowed: {allowed}")
    return {key: rule.check(prefix + key, given[key]) if key in given else rule.default for key, rule in rules.items()}
