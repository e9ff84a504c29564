"""The type checker over fedapp/, strategies/ and clients/ (mypy, configured in pyproject.toml's [tool.mypy]):
no error, and the typed run config catches what it is there to catch. One mypy run for both (a cold cache in a
tmp folder: about 5 s of CPU)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# a client handler that misreads its options and a common key: errors the typed config must report
MISREAD = """
from fedapp.client_context import ClientContext
from fedapp.protocols.espresso import EspressoOptions


def steps(ctx: ClientContext[EspressoOptions]) -> int:
    return ctx.cfg.options.stepz + ctx.cfg.sead


def rounds(ctx: ClientContext[EspressoOptions]) -> str:
    return ctx.cfg.num_server_rounds + ctx.cfg.options.steps
"""


def test_mypy_finds_no_error_and_the_typed_config_catches_misreads(tmp_path):
    probe = tmp_path / "misread.py"
    probe.write_text(MISREAD)
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                          "--cache-dir", str(tmp_path / "mypy-cache"), "fedapp", "strategies", "clients", str(probe)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    ours = [line for line in errors if not line.startswith(str(probe))]
    assert ours == [], "\n".join(ours)
    found = "\n".join(errors)
    assert '"EspressoOptions" has no attribute "stepz"' in found, out.stdout + out.stderr
    assert '"RunConfig[EspressoOptions]" has no attribute "sead"' in found, found
    assert 'Incompatible return value type (got "int", expected "str")' in found, found
    assert len(errors) == 3, found
