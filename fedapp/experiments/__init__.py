"""Table commands: `python -m fedapp.experiments <name> [options]`.

Each experiment is a module `fedapp/experiments/<name>.py` (dashes become underscores)
with `main(argv: list[str]) -> None`; it runs its grid of simulations, prints the table,
and writes JSON + PNGs under docs/ (the figures the README shows).
"""
