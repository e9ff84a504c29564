"""The README's `flwr run` commands use federation-config keys the installed Flower accepts."""

import re
from pathlib import Path

import pytest
from flwr.common.config import parse_config_args  # the parser `flwr run --federation-config` uses
from flwr.supercore.utils import simulation_config_from_json

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _as_flwr_run_reads_it(text: str):
    parsed = parse_config_args([text])
    return parsed, simulation_config_from_json({k.replace("-", "_"): v for k, v in parsed.items()})


def test_every_federation_config_in_the_readme_parses_as_flwr_run_parses_it():
    found = re.findall(r'--federation-config "([^"]+)"', README)
    assert len(found) >= 4  # the quickstart, two sizing examples, the GPU example
    for text in found:
        parsed, config = _as_flwr_run_reads_it(text)
        assert config.num_supernodes == parsed["num-supernodes"], text
        if "client-resources-num-gpus" in parsed:
            assert config.client_resources_num_gpus == parsed["client-resources-num-gpus"], text


def test_flwr_refuses_the_nested_key_the_readme_once_used():
    with pytest.raises(ValueError, match="Unknown simulation config field"):
        _as_flwr_run_reads_it("num-supernodes=4 backend.client-resources.num-cpus=1")


def _quickstart_commands() -> list[str]:
    section = README[README.index("\n## Quickstart"):]
    block = section[section.index("```bash\n") + 8:]
    return [line for line in block[:block.index("```")].splitlines() if line.strip()]


def test_ci_runs_the_readmes_test_command_from_the_lock():
    """CI proves what a user runs: .ci/run's install-and-test line is the README's second command, both
    install from the committed lock, and the lock pins every package (no resolver choices left)."""
    root = Path(__file__).resolve().parents[1]
    first, second = _quickstart_commands()
    ci = (root / ".ci" / "run").read_text()
    assert second in ci.splitlines()
    for command in (first, second):
        assert "pip install -r requirements.lock -e ." in command
    assert "PIP_NO_CACHE_DIR=1" in ci and "rm -rf .venv" in ci and "mktemp -d" in ci
    pins = [line for line in (root / "requirements.lock").read_text().splitlines() if line and line[0] != "#"]
    assert len(pins) > 50 and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[\w.+!]+", line) for line in pins), pins
    names = {line.split("==")[0].lower() for line in pins}
    assert {"torch", "flwr", "datasets", "pytest", "pytest-xdist"} <= names
