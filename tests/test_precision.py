"""The prior sampler's precision (espresso.precision): float32 untouched, bfloat16 autocast where asked,
`auto` by the CPU's own bfloat16 support. Tiny random-weight priors (TEST_CONFIG) only."""

import dataclasses

import pytest
import torch

from fedapp.config import ConfigError, parse_run_config
from fedapp.models import precision
from fedapp.models.prior import samplers
from fedapp.models.prior.samplers import SamplerSettings
from fedapp.models.prior.tiny import TEST_CONFIG, random_tiny_prior
from strategies import espresso as server

ZIGZAG = SamplerSettings(sampler="zigzag", num_steps=4, guidance=3.0, spacing="trailing", zigzag_t=600)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def prior():
    return random_tiny_prior(TEST_CONFIG, seed=0)


def _autocast_of_unet_calls(prior, run) -> list[tuple[bool, torch.dtype]]:
    """(autocast on?, its dtype) at every UNet call `run()` makes."""
    seen = []
    hook = prior.unet.register_forward_pre_hook(
        lambda _m, _a: seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))))
    try:
        run()
    finally:
        hook.remove()
    return seen


def _espresso_opts(value: str | None):
    flat = {"method": "espresso", "espresso.gamma1": 3.0, "espresso.steps": 3, "espresso.synth-batch": 4}
    return parse_run_config({**flat, **({"espresso.precision": value} if value else {})}).options


@pytest.mark.parametrize("value, native, expect", [
    (None, True, False),  # the default: float32, also on a CPU with bfloat16
    ("fp32", True, False), ("bf16", False, True), ("auto", True, True), ("auto", False, False)])
def test_the_run_configs_precision_reaches_the_servers_sampler(prior, monkeypatch, value, native, expect):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    opts = _espresso_opts(value)
    noise, cond = torch.randn(6, *prior.latent_shape), prior.null_condition(6)
    calls = _autocast_of_unet_calls(prior, lambda: server.denoise(prior, noise, cond, opts))
    assert len(calls) >= 2 * opts.steps  # two sampler calls (6 images, synth-batch 4)
    assert all(on == expect for on, _ in calls), calls
    assert all(dtype == torch.bfloat16 for on, dtype in calls if on)
    assert _autocast_of_unet_calls(prior, lambda: prior.unet(noise, 10, encoder_hidden_states=cond)) == [
        (False, torch.get_autocast_dtype("cpu"))]  # nothing left switched on after sampling


def test_float32_sampling_is_the_plain_loop_bit_for_bit_even_after_a_bf16_sample(prior):
    noise = torch.randn(5, *prior.latent_shape, generator=torch.Generator().manual_seed(3))
    prompt = "a photo of the digit three"
    bf16 = prior.sample(noise, prompt, dataclasses.replace(ZIGZAG, precision="bf16")).images  # caches ∅ first
    fp32 = prior.sample(noise, prompt, ZIGZAG)
    fresh = random_tiny_prior(TEST_CONFIG, seed=0)  # the loop, called directly, with no precision anywhere
    z0 = samplers.zigzag_loop(fresh, noise.clone(), fresh.condition(prompt, 5), None, ZIGZAG.num_steps,
                              ZIGZAG.guidance, ZIGZAG.gamma2, ZIGZAG.zigzag_t, ZIGZAG.spacing, ZIGZAG.zigzag)
    assert torch.equal(fp32.latents, z0) and torch.equal(fp32.images, fresh.decode_latents(z0))
    assert fp32.images.dtype == bf16.dtype == torch.float32  # the UNet's bf16 output is cast back
    diff = (bf16 - fp32.images).abs()
    assert 0 < diff.max() and diff.mean() < 0.05  # bfloat16 rounding: close to float32, not equal


def test_a_bad_precision_is_refused_in_one_line_naming_key_value_and_choices():
    with pytest.raises(ConfigError, match=r"^espresso\.precision='fp16': must be one of 'auto', 'fp32', 'bf16'$"):
        parse_run_config({"method": "espresso", "espresso.precision": "fp16"})
    with pytest.raises(ValueError, match=r"^precision='half': allowed auto, fp32, bf16$"):
        precision.resolve("half", "cpu")


@pytest.mark.parametrize("flags, native", [("fpu avx512f avx512_bf16 avx512_vp2intersect", True),
                                           ("fpu avx512f amx_bf16 amx_tile", True), ("fpu avx2 avx512f", False)])
def test_auto_is_bf16_only_on_a_cpu_that_lists_native_bfloat16(tmp_path, monkeypatch, flags, native):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: some cpu\nflags\t\t: {flags}\n")
    assert precision.cpu_has_native_bf16(str(info)) is native
    assert precision.cpu_has_native_bf16(str(tmp_path / "missing")) is False  # unreadable: no
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    assert precision.resolve("auto", "cpu") == ("bf16" if native else "fp32")
    assert precision.resolve("auto", "cuda") == "fp32" and precision.resolve("bf16", "cuda") == "bf16"


def test_the_accuracy_benchmark_pairs_seeds_and_counts_where_bf16_is_lower():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from precision_accuracy import paired

    got = paired({"0": {"fp32": 0.80, "bf16": 0.78}, "1": {"fp32": 0.70, "bf16": 0.71}, "2": {"fp32": 0.5}})
    assert got["seeds"] == ["0", "1"] and got["bf16_lower"] == 1  # seed 2 has no pair
    assert abs(got["mean_points"] - (-0.5)) < 1e-9 and abs(got["std_points"] - 2.1213203) < 1e-6
