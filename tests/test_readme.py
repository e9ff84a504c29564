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
