"""The run config: defaults in code match pyproject.toml; user errors are one clear line."""

import tomllib
from pathlib import Path

import pytest

from fedapp.config import ConfigError, all_defaults, parse_run_config

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_key_with_its_code_default():
    # Flower only accepts --run-config overrides for keys pyproject.toml lists.
    flat = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]

    def flatten(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flatten(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    assert dict(flatten(flat)) == all_defaults()


def test_defaults_parse_and_flat_round_trips():
    cfg = parse_run_config(all_defaults())
    again = parse_run_config(cfg.flat())
    assert again.flat() == cfg.flat()
    assert cfg.num_server_rounds >= 1


def test_int_is_accepted_for_float_and_partitioner_params_are_typed():
    cfg = parse_run_config({"lr": 1, "partitioner": "dirichlet", "partitioner.alpha": 1})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.partitioner_params["alpha"] == 1.0


@pytest.mark.parametrize("flat, needle", [
    ({"method": "nope"}, "method='nope': must be one of"),
    ({"lr": -0.1}, "lr=-0.1: must be > 0.0"),
    ({"num-server-rounds": 0}, "num-server-rounds=0: must be >= 1"),
    ({"num-server-rounds": "3"}, "num-server-rounds='3': must be of type int"),
    ({"partitioner": "dirichlet", "partitioner.alpha": -1.0}, "partitioner.alpha"),
    ({"bogus-key": 1}, "bogus-key=1: unknown key"),
    ({"fedprox.mu": -1.0}, "fedprox.mu=-1.0: must be >= 0.0"),
    ({"fedprox.nu": 1.0}, "fedprox.nu=1.0: unknown key"),
    ({"device": "tpu"}, "device='tpu'"),
    ({"lr": float("inf")}, "lr=inf: must be a finite number"),
    ({"round-timeout": float("nan")}, "round-timeout=nan: must be a finite number"),
    ({"run-name": "../../x"}, "run-name='../../x': must be a plain folder name"),
    ({"run-name": ".."}, "run-name='..': must be a plain folder name"),
    ({"pfdm.channels": "abc"}, "pfdm.channels='abc': must be comma-separated positive integers"),
])
def test_bad_values_give_one_line_naming_key_and_allowed(flat, needle):
    with pytest.raises(ConfigError) as err:
        parse_run_config(flat)
    msg = str(err.value)
    assert needle in msg
    assert "\n" not in msg
