"""Paper tables as grids of run configs executed by the real strategies:
`python -m experiments <name> [options]`, from the repository root.

Each experiment is a module `experiments/<name>.py` (dashes become underscores) with
`main(argv: list[str]) -> None`; it parses its options with argparse, runs its grid through
`fedapp.simulation.simulate_in_process` or `fedapp.simulate`, prints the table, and writes JSON +
PNGs under `--out` (default docs/results/, the figures the README and docs/*.md show). `--help` writes nothing.
`common.py` holds what several experiments share; it is not an experiment. The package is a dev
tool of this repository, not part of the installed app.
"""
