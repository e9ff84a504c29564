"""Lint: `ruff check` (the rules and line length of [tool.ruff] in pyproject.toml) finds nothing in the
project's Python folders."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("fedapp", "strategies", "clients", "feddata", "experiments", "benchmarks", "tests")


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (pip install -e '.[test]' brings it)")
def test_ruff_check_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *FOLDERS],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"ruff check found problems:\n{out.stdout}{out.stderr}"


def test_the_warning_policy_exempts_a_leaked_file_collected_mid_run_and_nothing_else(tmp_path):
    """tests/warning_policy.py in the order the end-to-end tests use it (decorator above "error", list after
    it): a file leaked earlier and closed by the garbage collector during the test passes; a warning fails."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "test_policy.py").write_text(
        "import gc, warnings, pytest\n"
        "from warning_policy import GC_OF_EARLIER_LEAKS\n"
        "@pytest.mark.filterwarnings(GC_OF_EARLIER_LEAKS)\n"
        "@pytest.mark.filterwarnings('error')\n"
        "def test_leak():\n"
        "    open(__file__)  # unclosed: a ResourceWarning when collected\n"
        "    gc.collect()\n"
        "pytestmark = [pytest.mark.filterwarnings('error'), pytest.mark.filterwarnings(GC_OF_EARLIER_LEAKS)]\n"
        "def test_warning():\n"
        "    warnings.warn('a run printed this', UserWarning)\n")
    tests = Path(__file__).parent
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "default",
                          str(tmp_path / "test_policy.py")], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tests)})
    assert "1 failed, 1 passed" in out.stdout, out.stdout[-2000:]  # without the mark: 2 failed (measured)
    assert "test_warning" in out.stdout and "UserWarning: a run printed this" in out.stdout
