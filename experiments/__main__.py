"""Dispatch `python -m experiments <name> ...` to experiments/<name>.py."""

import importlib
import pkgutil
import sys

import experiments as pkg

NOT_EXPERIMENTS = ("common", "cli", "espresso_condition_learners", "audit_targets")  # modules others import, no main


def available() -> list[str]:
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(pkg.__path__)
                  if not m.name.startswith("_") and m.name not in NOT_EXPERIMENTS)


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m experiments <name> [options]\nexperiments: " + ", ".join(available()))
        return
    name = argv[0]
    if name not in available():
        sys.exit(f"experiment={name!r}: must be one of {', '.join(available())}")
    importlib.import_module(f"experiments.{name.replace('-', '_')}").main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
