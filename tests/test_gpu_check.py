"""The GPU check's CPU dry run: the same script a bare GPU box runs, so it cannot rot."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402


def test_the_quick_cpu_run_times_the_unet_and_runs_espresso_and_every_other_method_in_process(tmp_path):
    out = tmp_path / "gpu_check.json"
    gpu_check.main(["--device", "cpu", "--quick", "--in-process", "--clients", "2", "--out", str(out)])
    r = json.loads(out.read_text())
    unet = r["sd15_size_unet_batch"]
    assert r["device"] == "cpu" and r["quick"] and unet["dtype"] == "float32" and unet["peak_memory_mib"] is None
    assert unet["images_per_second"] > 0 and unet["latents"] == [4, 8, 8] and unet["batch"] == unet["steps"] == 2
    e = r["espresso"]
    assert e["status"] == "completed" and e["in_process"] and e["clients"] == 2 and e["latent_shape"] == [4, 16, 16]
    assert e["num_synthetic"] > 0 and e["phase_seconds"]["synthesis"] > 0
    others = r["other_methods"]
    assert set(others) == {"fedavg", "moon", "feddifrc", "pfdm", "dcfm-a", "dcfm-b"}
    assert all(o["status"] == "completed" and o["failures"] == 0 and o["wall_seconds"] > 0 for o in others.values())
    assert [others[m]["rounds"] for m in ("fedavg", "moon", "feddifrc")] == [1, 1, 1]
    assert others["dcfm-a"]["phase_seconds"]["peer_round1"] > 0 and others["dcfm-b"]["phase_seconds"]["distill"] > 0


def test_the_other_methods_run_at_their_tables_configs_but_one_round():
    """Full (not --quick) rows: each table's own config function's output, rounds cut to one."""
    from experiments import dcfm, feddifrc, pfdm

    rows = {name: (cfg, n) for name, cfg, n in gpu_check.other_method_rows("runs", "/p32", quick=False)}
    fd = feddifrc.parser().parse_args(["--runs-dir", "runs"])
    assert rows["fedavg"] == ({**feddifrc.cell_config(fd, 0, "a0.1", "fedavg"), "num-server-rounds": 1}, 10)
    assert rows["moon"][0]["dataset"] == "mnist-5k" and rows["moon"][0]["local-epochs"] == 2
    assert rows["feddifrc"][0]["prior"] == "/p32" and rows["feddifrc"][0]["image-size"] == 32
    assert rows["pfdm"] == (pfdm.config(pfdm.parser().parse_args(["--runs", "runs"]), "pfdm", 0), 4)
    for name in ("dcfm-a", "dcfm-b"):
        cfg, n = rows[name]
        assert n == 5 and cfg["partitioner.split"] == "non-iid"
        assert {k: cfg[k] for k in dcfm.SETTINGS} == dcfm.SETTINGS


def test_the_full_size_unet_is_stable_diffusion_1_5s():
    from diffusers import UNet2DConditionModel

    with __import__("torch").device("meta"):  # the real config, no memory
        unet = UNet2DConditionModel(**gpu_check.SD15_UNET)
    assert 855e6 < sum(p.numel() for p in unet.parameters()) < 865e6  # SD-1.5's UNet: 859.5 M


def test_a_missing_module_is_named_in_one_line_before_anything_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "NEEDED", gpu_check.NEEDED + ("no_such_module_xyz",))
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--device", "cpu", "--quick", "--in-process", "--out", str(tmp_path / "x.json")])
    message = str(exit_.value)
    assert message.startswith("gpu_check: missing Python modules: no_such_module_xyz") and "\n" not in message
    assert not (tmp_path / "x.json").exists()
    assert gpu_check.missing_modules(in_process=True) == ["no_such_module_xyz"]  # the rest are here


def test_the_wheel_set_is_the_checks_imports_and_their_requirements_without_torch():
    import gpu_wheels

    pins = gpu_wheels.needed()
    assert "torch" not in pins and "sympy" not in pins  # the box has torch and what torch requires
    assert {"flwr", "diffusers", "transformers", "scikit-learn", "mlxtend"} <= set(pins)
    assert {"pyarrow", "scipy", "grpcio"} <= set(pins)  # required by datasets, scikit-learn, flwr: pip needs them
    assert "ray" not in pins  # in process: flwr without its simulation extra
    import importlib.metadata as md

    assert pins["diffusers"] == md.version("diffusers")  # the tested version, pinned


def test_the_box_keeps_its_own_packages_and_the_wheels_are_fetched_for_its_python(tmp_path):
    import gpu_wheels

    box = gpu_wheels.box_packages(gpu_wheels.BOX_LIST)  # the device image's list, as shipped
    assert {"torch", "transformers", "numpy", "scikit-learn", "grpcio", "huggingface-hub"} <= box
    assert "flwr" not in box and "diffusers" not in box
    pins = gpu_wheels.needed(box)
    assert {"flwr", "diffusers", "flwr-datasets", "datasets", "mlxtend", "dp-accounting"} <= set(pins)
    assert "dill" in pins  # datasets requires it and the box lacks it: the closure still walks the box's gaps
    assert not {"transformers", "numpy", "scikit-learn", "pyarrow", "scipy"} & set(pins)  # the box has them
    assert {"grpcio", "protobuf"} <= set(pins)  # pinned even though the box has them
    assert "uv" not in pins and "uv" not in gpu_wheels.needed()  # a program flwr runs, never imported
    (tmp_path / "box.txt").write_text("# a comment\nFoo_Bar  baz.qux\n\n  zed # trailing\n")
    assert gpu_wheels.box_packages(tmp_path / "box.txt") == {"foo-bar", "baz-qux", "zed"}
    assert gpu_wheels.box_packages("") == set()
    cmd = gpu_wheels.download_command(["flwr==1.0"], tmp_path, "3.12")
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in cmd and "--no-deps" in cmd
    assert cmd[cmd.index("--implementation") + 1] == "cp" and cmd[-1] == "flwr==1.0" and "download" in cmd
    assert "manylinux2014_x86_64" in cmd


def test_a_second_fetch_into_the_same_folder_leaves_one_wheel_a_distribution(tmp_path, monkeypatch):
    import gpu_wheels

    for stale in ("cryptography-50.0.2-cp311-abi3-manylinux_2_28_x86_64.whl", "flwr-1.0-py3-none-any.whl"):
        (tmp_path / stale).write_bytes(b"old")
    (tmp_path / "part-1").mkdir()
    (tmp_path / "part-1" / "grpcio-1.0-cp312-cp312-manylinux2014_x86_64.whl").write_bytes(b"old")
    fetched = "cryptography-50.0.2-cp311-abi3-manylinux_2_34_x86_64.whl"

    def pip(cmd, check):  # what pip download leaves: the one wheel it picks
        assert check and cmd[-1] == "cryptography==50.0.2"
        (tmp_path / fetched).write_bytes(b"new")

    monkeypatch.setattr(gpu_wheels.subprocess, "run", pip)
    gpu_wheels.write_wheels({"cryptography": "50.0.2"}, tmp_path, "3.12")
    assert sorted(p.name for p in tmp_path.rglob("*.whl")) == [fetched]
    assert (tmp_path / "requirements.txt").read_text() == "cryptography==50.0.2\n"


def test_wheels_are_sorted_into_parts_that_each_fit_the_limit(tmp_path):
    import gpu_wheels

    sizes = {"a": 50, "b": 30, "c": 30, "d": 20, "e": 5, "f": 1}  # MiB
    for name, mib in sizes.items():
        with open(tmp_path / f"{name}-1.0-py3-none-any.whl", "wb") as f:
            f.truncate(mib * 2**20)  # sparse: the size without the bytes
    (tmp_path / "requirements.txt").write_text("a==1.0\n")
    parts = gpu_wheels.split_into_parts(tmp_path, 60)
    held = [{p.name.split("-")[0] for p in part.glob("*.whl")} for part in parts]
    assert sorted(n for h in held for n in h) == sorted(sizes)  # every wheel in exactly one part
    assert all(sum(sizes[n] for n in h) <= 60 for h in held) and len(parts) == 3  # 136 MiB: 3 parts of <= 60
    assert (parts[0] / "requirements.txt").exists() and not list(tmp_path.glob("*.whl"))
    (parts[0] / "a-1.0-py3-none-any.whl").rename(tmp_path / "a-1.0-py3-none-any.whl")
    with pytest.raises(SystemExit, match="a-1.0-py3-none-any.whl alone is 50.0 MiB, over --limit-mib=40"):
        gpu_wheels.split_into_parts(tmp_path, 40)
