"""The configuration reference, docs/configuration.md, generated from the code: every run-config key with its
type, default, allowed values and help. Keys and defaults are `fedapp.config.all_defaults()` (what pyproject.toml
lists); types, ranges, choices and help are the options dataclasses' `opt(...)` metadata and feddata's
partitioner tables; where a check outside that metadata decides what a key allows, the reference quotes that
check's own refusal.

    python -m fedapp.reference --write   # after adding or changing a key (without --write: print it)
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from fedapp.config import APP_NAMESPACES, CommonConfig, all_defaults, parse_run_config
from fedapp.options import Rule, options_of

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
COMMAND = "python -m fedapp.reference --write"


def _refusals() -> dict[str, Callable[[], Any]]:
    """Keys whose allowed values a check outside their field's metadata decides: a call that check refuses."""
    from feddata.sources import check_dataset
    from fedapp.models.prior.spec import resolve_prior
    from fedapp.preflight import check_model, check_out_dir, check_resume

    def run(key: str, value: Any) -> Callable[[], Any]:
        return lambda: parse_run_config({key: value})

    def stub(**fields: Any) -> Any:  # a run config with the fields a check reads
        return SimpleNamespace(**fields)

    return {"method": run("method", "?"), "device": run("device", "?"), "run-name": run("run-name", ".."),
            "pfdm.channels": run("pfdm.channels", "?"), "feddifrc.up-blocks": run("feddifrc.up-blocks", "?"),
            "dataset": lambda: check_dataset(""), "prior": lambda: resolve_prior("?/?/?"),
            "model": lambda: check_model(stub(model="?/?/?")),
            "out-dir": lambda: check_out_dir(stub(out_dir=__file__)),  # a file, not a folder
            "resume": lambda: check_resume(stub(resume="?/?/?", method="fedavg", spec=stub(resumable=True)))}


def _refusal(call: Callable[[], Any]) -> str:
    """What the check says is allowed: its message after "allowed: " or "must be ", up to a "; "."""
    try:
        call()
    except ValueError as err:
        msg = str(err)
        for marker in ("allowed: ", "must be "):
            if marker in msg:
                return msg.split(marker, 1)[1].split("; ")[0]
        raise AssertionError(f"no allowed values in {msg!r}") from None
    raise AssertionError("the probe of a check was accepted")


def _allowed(rule: Rule) -> str:
    """A rule's allowed values as its refusal states them; a rule that checks nothing here (a string checked
    against the data before the run), its reason."""
    if rule.type is bool:
        return "true, false"
    if rule.choices is None and rule.low is None and rule.high is None:
        return rule.reason
    return rule.allowed()


def _options(cls: type, prefix: str = "") -> dict[str, tuple[str, str, str]]:
    """key -> (type, allowed, help) of an options dataclass."""
    return {prefix + key: (o.rule.type.__name__, _allowed(o.rule), o.rule.help) for key, o in options_of(cls).items()}


def _partitioner_params() -> dict[str, tuple[str, str, str]]:
    """key -> (type, allowed, help) of every partitioner parameter (feddata.partition)."""
    from feddata.partition import PARAMS, PARTITIONER_PARAMS

    out = {}
    for key, rule in PARAMS.items():
        names = [name for name, spec in PARTITIONER_PARAMS.items() if key in spec]
        used = "every partitioner" if len(names) == len(PARTITIONER_PARAMS) else ", ".join(names)
        out[f"partitioner.{key}"] = (rule.type.__name__, _allowed(rule), f"{rule.help} (used by: {used})")
    return out


def rows() -> dict[str, dict[str, dict[str, str]]]:
    """Group ("run", "partitioner" or a namespace) -> key -> {type, default, allowed, help}, in pyproject's order."""
    from fedapp import registry

    info = {**_options(CommonConfig), **_partitioner_params()}
    for ns in registry.namespaces():
        info.update(_options(registry.options_class(ns), f"{ns}."))
    for ns, cls in APP_NAMESPACES.items():
        info.update(_options(cls, f"{ns}."))
    refusals = _refusals()
    out: dict[str, dict[str, dict[str, str]]] = {}
    for key, default in all_defaults().items():
        typ, allowed, help_ = info[key]
        if key in refusals:
            allowed = _refusal(refusals[key])
        text = str(default).lower() if isinstance(default, bool) else json.dumps(default)  # as pyproject writes it
        group = key.split(".", 1)[0] if "." in key else "run"
        out.setdefault(group, {})[key] = {"type": typ, "default": f"`{text}`",
                                          "allowed": allowed or "any, not checked before the run", "help": help_}
    return out


def _intro(group: str) -> str:
    from fedapp import registry

    if group == "run":
        return "Top-level keys; each method reads those that apply to it."
    if group == "partitioner":
        return "`partitioner.name` picks the partitioner; the other keys are parameters of the partitioners named."
    if group in APP_NAMESPACES:
        return "Read by every run."
    return "Read by " + ", ".join(f"`method={m}`" for m, s in registry.METHODS.items() if s.namespace == group) + "."


def _cell(text: str) -> str:
    """Text for a table cell: pipes escaped; outside `code` also backslashes, and `<` (GitHub drops <out-dir>)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("\\", "\\\\").replace("<", "\\<")
    return "`".join(parts).replace("|", "\\|")


def markdown() -> str:
    lines = ["# Configuration reference", "",
             'Set any key with `flwr run . --run-config "key=value ..."` (strings quoted: '
             "`--run-config \"method='fedavg' num-server-rounds=10\"`) or list them in a TOML file and pass "
             f"`--run-config file.toml`; this page is generated from the code by `{COMMAND}`, do not edit it."]
    for group, keys in rows().items():
        lines += ["", f"## {group}", "", _intro(group), "", "| key | type | default | allowed | help |",
                  "|---|---|---|---|---|"]
        for key, r in keys.items():
            cells = [f"`{key}`", r["type"], _cell(r["default"]), _cell(r["allowed"]), _cell(r["help"])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m fedapp.reference", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(DOC.parents[1])} (else print it)")
    if ap.parse_args(argv).write:
        tmp = DOC.with_suffix(".md.tmp")
        tmp.write_text(markdown())
        tmp.replace(DOC)
    else:
        print(markdown(), end="")


if __name__ == "__main__":
    main()
