"""The run config: defaults in code match pyproject.toml; user errors are one clear line."""

import tomllib
from pathlib import Path

import pytest

import feddata
import numpy as np
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
    ({"lr": -0.1}, "lr=-0.1: must be > 0"),
    ({"num-server-rounds": 0}, "num-server-rounds=0: must be >= 1"),
    ({"num-server-rounds": "3"}, "num-server-rounds='3': must be of type int"),
    ({"partitioner": "dirichlet", "partitioner.alpha": -1.0}, "partitioner.alpha"),
    ({"bogus-key": 1}, "bogus-key=1: unknown key"),
    ({"fedprox.mu": -1.0}, "fedprox.mu=-1.0: must be >= 0"),
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


# ---- one check for every entry point (feddata.validation) -------------------------------------------------------
def _app(key: str, **extra):
    """A bad value for `key` through the run config, with `extra` keys (the partitioner that reads it)."""
    return lambda v: parse_run_config({**all_defaults(), **extra, key: v})


# (key, how a value reaches its check): a run-config option, a partitioner parameter (through the run config and
# through feddata's own call), a data call's argument (through the run config and through feddata's)
INT_AT_LEAST_0 = [
    ("espresso.embed-steps", _app("espresso.embed-steps")),
    ("partitioner.min-partition-size", _app("partitioner.min-partition-size", **{"partitioner.name": "dirichlet"})),
    ("partitioner.min-partition-size", lambda v: feddata.resolve_params("dirichlet", {"min-partition-size": v})),
    ("seed", _app("seed")),
    ("seed", lambda v: feddata.validate("digits", "iid", {}, 2, seed=v)),
]
FLOAT_ABOVE_0 = [
    ("lr", _app("lr")),
    ("partitioner.alpha", _app("partitioner.alpha", **{"partitioner.name": "dirichlet"})),
    ("partitioner.alpha", lambda v: feddata.resolve_params("dirichlet", {"alpha": v})),
]
# one rule everywhere: an int key takes an integer only, a float key an integer or a finite float
BAD_INTS = [("3", "must be of type int"), (2.0, "must be of type int"), (True, "must be of type int"),
            (None, "must be of type int"), (-1, "must be >= 0")]
BAD_FLOATS = [("0.5", "must be of type float"), (False, "must be of type float"),
              (float("nan"), "must be a finite number"), (float("inf"), "must be a finite number"),
              (0, "must be > 0"), (-0.5, "must be > 0")]
ENTRY_POINTS = [(key, call, BAD_INTS) for key, call in INT_AT_LEAST_0] + \
    [(key, call, BAD_FLOATS) for key, call in FLOAT_ABOVE_0]


@pytest.mark.parametrize("key, call, bad", ENTRY_POINTS, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(ENTRY_POINTS)])
def test_a_bad_value_is_refused_alike_at_every_entry_point(key, call, bad):
    for value, allowed in bad:
        with pytest.raises(ConfigError) as err:
            call(value)
        assert str(err.value) == f"{key}={value!r}: {allowed}", value


@pytest.mark.parametrize("key, call, good, typed", [
    ("partitioner.min-partition-size", lambda v: feddata.resolve_params("dirichlet", {"min-partition-size": v}),
     np.int64(3), 3),
    ("partitioner.alpha", lambda v: feddata.resolve_params("dirichlet", {"alpha": v}), 1, 1.0),
    ("lr", lambda v: parse_run_config({"lr": v}).lr, 1, 1.0),
])
def test_what_means_the_same_number_is_taken_as_the_keys_type(key, call, good, typed):
    out = call(good)
    value = out[key.removeprefix("partitioner.")] if isinstance(out, dict) else out
    assert value == typed and type(value) is type(typed)


def test_image_size_is_one_rule_with_a_declared_reason_for_built_ins():
    from feddata.sources import check_image_size

    with pytest.raises(ConfigError, match=r"^image-size=1025: must be 'auto' or in \[8, 1024\]$"):
        parse_run_config({"image-size": 1025})
    with pytest.raises(ConfigError, match=r"^image-size=1025: must be in \[8, 1024\]$"):
        check_image_size("a/folder", 1025)
    assert check_image_size("a/folder", 1024) == 1024 and parse_run_config({"image-size": 1024}).image_size == 1024
    with pytest.raises(ConfigError, match=r"^image-size=65: must be in \[8, 64\] \(a built-in dataset is rendered"):
        check_image_size("digits", 65)
    with pytest.raises(ConfigError, match=r"^classifier-size=7: must be 'auto' or in \[8, 1024\]$"):
        parse_run_config({"classifier-size": 7})


def test_partitioner_defaults_are_feddatas():
    """The app's defaults (pyproject.toml) and a feddata call without parameters read the same rules."""
    for name, spec in feddata.PARTITIONER_PARAMS.items():
        assert feddata.resolve_params(name, {}) == parse_run_config({"partitioner.name": name}).partitioner_params
        assert {k: all_defaults()[f"partitioner.{k}"] for k in spec} == feddata.resolve_params(name, {})
    assert feddata.resolve_params("iid", {})["per-class"] == 16


def test_a_parameter_of_another_partitioner_is_checked_but_not_kept():
    with pytest.raises(ConfigError, match=r"^partitioner.alpha='x': must be of type float$"):
        parse_run_config({"partitioner.name": "iid", "partitioner.alpha": "x"})
    cfg = parse_run_config({"partitioner.name": "iid", "partitioner.alpha": 2.0})
    assert cfg.partitioner_params == {"per-class": 16}


def test_the_run_config_reads_every_common_key_typed():
    """cfg.<key> is cfg.common.<key> for every common key (image-size and classifier-size: resolved)."""
    import dataclasses

    from fedapp.config import CommonConfig

    cfg = parse_run_config({"image-size": 16, "classifier-size": 8, "seed": 3})
    for f in dataclasses.fields(CommonConfig):
        assert getattr(cfg, f.name) == getattr(cfg.common, f.name), f.name
    with pytest.raises(AttributeError):
        cfg.sead  # noqa: B018 (a typo is an error, not a silent None)


# ---- the method contract (fedapp.registry.MethodSpec) and the keys a run keeps ------------------------------
def test_each_method_spec_states_its_traits():
    from fedapp import registry

    m = registry.METHODS
    assert m["fedavg"].resumable and not m["centralized"].resumable  # centralized is one-shot: no checkpoint
    assert not m["moon"].resumable  # its clients' previous models live in node state, not in the checkpoint
    assert registry.names(lambda s: s.resumable) == ["fedavg", "fedprox", "feddifrc"]
    assert registry.names(lambda s: s.samples_clients) == ["fedavg", "fedprox", "moon", "feddifrc"]
    assert m["feddifrc"].uses_prior and not m["fedavg"].uses_prior
    assert registry.names(lambda s: s.uses_prior) == ["feddifrc", "espresso", "prompts", "class-embed"]
    assert registry.names(lambda s: s.preflight) == ["feddifrc", "espresso", "prompts", "class-embed"]
    assert m["fedavg"].namespace is None and m["fedprox"].namespace == "fedprox" and m["dpdm"].namespace == "pfdm"
    assert (m["espresso"].server_only_keys < set(all_defaults())
            and "espresso.clusters" not in m["espresso"].server_only_keys)
    # what DCFM's clients read (clients/dcfm.py) is never server-only: a cached Stage I must match the run's
    client_read = {"dcfm.lambda-ci", "dcfm.local-steps", "dcfm.peer-steps", "dcfm.lr", "dcfm.pi-full", "dcfm.width",
                   "dcfm.routes-per-batch", "dcfm.route-mask", "dcfm.ci-batch"}
    assert m["dcfm"].server_only_keys < set(all_defaults()) and not client_read & m["dcfm"].server_only_keys
    # keys a message type's handler does not read are real keys, each read by some other message of the method
    assert m["dcfm"].unread_keys["train"] < client_read and not m["fedavg"].unread_keys
    with pytest.raises(ValueError, match="namespace and options go together"):
        registry.MethodSpec("p", "s:S", "c", namespace="x")


def test_each_spec_names_what_its_modules_hold():
    """The import strings resolve, and the traits agree with the code that honours them: Flower FedAvg's
    client sampling and the per-round checkpoint live in strategies.fedavg.FedAvgStrategy."""
    import dataclasses

    from fedapp import registry
    from strategies.fedavg import FedAvgStrategy

    for name, spec in registry.METHODS.items():
        strategy = registry.strategy_class(name)
        assert spec.samples_clients == issubclass(strategy, FedAvgStrategy), name
        assert not spec.resumable or issubclass(strategy, FedAvgStrategy), name
        assert registry.protocol(name).PHASES and registry.client_handlers(name), name
        if spec.namespace:
            assert dataclasses.is_dataclass(registry.options_class(spec.namespace)), name
        if spec.preflight:
            assert callable(registry.preflight_check(name)), name


def test_a_run_keeps_the_common_keys_and_its_methods_namespace_only():
    from fedapp.config import method_scoped

    others = ("dcfm.", "pfdm.", "espresso.", "feddifrc.", "moon.", "fedprox.")
    fedavg = parse_run_config({**all_defaults(), "method": "fedavg"}).flat()
    assert not [k for k in fedavg if k.startswith(others)]
    assert {"lr", "method", "image-size", "partitioner.name", "log.tensorboard"} <= set(fedavg)
    dcfm = parse_run_config({**all_defaults(), "method": "fedflow", "dcfm.width": 48}).flat()
    assert dcfm["dcfm.width"] == 48 and not [k for k in dcfm if k.startswith(others[1:])]
    # what a client receives lacks other namespaces and parses to the same run
    assert parse_run_config(dcfm).flat() == dcfm
    old = method_scoped({**all_defaults(), "dcfm.width": 48}, "fedflow")  # a config.json of before: every method's keys
    assert old["dcfm.width"] == 48 and "lr" in old and not [k for k in old if k.startswith(others[1:])]
    with pytest.raises(ConfigError, match="pfdm.batch=0"):  # other namespaces given are still validated
        parse_run_config({**all_defaults(), "method": "fedavg", "pfdm.batch": 0})


def test_choosing_fedavg_imports_no_diffusion_code(tmp_path):
    """A fedavg client parses its record without loading another protocol; the server, given every
    namespace's defaults, validates them (loading their options) but imports no diffusers."""
    import subprocess
    import sys

    code = ("import sys; from fedapp.config import all_defaults, parse_run_config; "
            "from fedapp.preflight import preflight\n"
            f"flat = {{'method': 'fedavg', 'dataset': 'digits', 'partitioner.name': 'iid', "
            f"'out-dir': {str(tmp_path)!r}}}\n"
            "parse_run_config(parse_run_config(flat).flat())\n"
            "print(sorted(m for m in sys.modules if m.startswith(('fedapp.protocols.', 'strategies'))))\n"
            "cfg = parse_run_config({**all_defaults(), **flat}); preflight(cfg); cfg.image_size\n"
            "print(sorted(m for m in sys.modules if m.startswith(('diffusers', 'strategies'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.split() == ["[]", "[]"]


def test_device_auto_in_a_ray_actor_given_no_gpu_is_the_cpu(monkeypatch):
    """fedapp lets Ray show every GPU to every actor (RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0, which silences Ray's
    FutureWarning): an actor with no GPU assigned must still train on the CPU, one with a GPU on it."""
    import torch

    import fedapp.config as C

    cfg = parse_run_config({**all_defaults(), "device": "auto"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(C, "ray_gpu_ids", lambda: [])
    assert cfg.torch_device() == "cpu"
    monkeypatch.setattr(C, "ray_gpu_ids", lambda: ["0"])
    assert cfg.torch_device() == "cuda"
    monkeypatch.setattr(C, "ray_gpu_ids", lambda: None)  # not a Ray actor: the driver, an in-process run
    assert cfg.torch_device() == "cuda"


def test_fedapp_opts_into_rays_future_accelerator_behaviour():
    import os

    import fedapp  # noqa: F401

    assert os.environ["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] == "0"


@pytest.mark.parametrize("dataset, shown", [("mnist-5k", "mnist-5k"), ("flwrlabs/pacs", "pacs"),
                                            ("/home/me/data/domainnet/", "domainnet"), ("~/data/nico++", "nico_")])
def test_the_default_run_name_is_one_plain_folder_name_whatever_the_dataset(dataset, shown):
    import re

    from fedapp.config import parse_run_config

    name = parse_run_config({"method": "fedavg", "dataset": dataset}).resolved_run_name
    assert re.fullmatch(rf"fedavg-{re.escape(shown)}-domain-s0-\d{{8}}-\d{{6}}", name), name
