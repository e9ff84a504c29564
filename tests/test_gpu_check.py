"""The GPU check's CPU dry run (issue 31 item 3): the same script a bare GPU box runs, so it cannot rot."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402


def test_the_quick_cpu_run_times_the_unet_and_runs_espresso_in_process(tmp_path):
    out = tmp_path / "gpu_check.json"
    gpu_check.main(["--device", "cpu", "--quick", "--in-process", "--clients", "2", "--out", str(out)])
    r = json.loads(out.read_text())
    unet = r["sd15_size_unet_batch"]
    assert r["device"] == "cpu" and r["quick"] and unet["dtype"] == "float32" and unet["peak_memory_mib"] is None
    assert unet["images_per_second"] > 0 and unet["latents"] == [4, 8, 8] and unet["batch"] == unet["steps"] == 2
    e = r["espresso"]
    assert e["status"] == "completed" and e["in_process"] and e["clients"] == 2 and e["latent_shape"] == [4, 16, 16]
    assert e["num_synthetic"] > 0 and e["phase_seconds"]["synthesis"] > 0


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
