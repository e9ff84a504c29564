"""fedapp.plan: its counts against the code's own formulas, its bytes against the records a run sends, its
parameter counts against real modules, the meta-device path, and one clear error for bad input."""

import json
import math
import subprocess
import sys

import pytest
import torch

from fedapp.plan import COUNTERS, counters_of, make_plan
from fedapp.plan.inputs import read_run_config

ESPRESSO = {"method": "espresso", "partitioner.per-class": 2, "min-clients": 2, "espresso.embed-steps": 3,
            "espresso.steps": 4, "espresso.ratio": 1.5, "espresso.embed-batch": 8, "espresso.synth-batch": 16,
            "espresso.mixup-pairs": 8, "espresso.diffusions-per-latent": 2, "server-epochs": 2}
FEDAVG = {"method": "fedavg", "dataset": "digits", "partitioner.name": "iid", "partitioner.per-class": 3,
          "num-server-rounds": 2, "local-epochs": 1, "fraction-evaluate": 0.0, "min-clients": 2}


@pytest.fixture(scope="module")
def prior_dir(tmp_path_factory):
    from fedapp.models.prior.tiny import TEST_CONFIG, random_tiny_prior

    prior = random_tiny_prior(TEST_CONFIG, dataset="digit-styles", seed=0)
    return str(prior.save_pretrained(tmp_path_factory.mktemp("prior") / "tiny-random"))


def _terms(plan, what):
    return [t for t in plan["terms"] if t["what"].startswith(what)]


def test_espresso_counts_are_the_codes_formulas(prior_dir):
    from fedapp.config import all_defaults, parse_run_config
    from fedapp.data import client_shard
    from fedapp.models.prior.samplers import expected_unet_evals
    from strategies.espresso import images_per_class

    plan = make_plan({**ESPRESSO, "prior": prior_dir}, 2, bench=False)
    cfg = parse_run_config({**all_defaults(), **ESPRESSO, "prior": prior_dir, "image-size": 16})
    o = cfg.options
    counts = [torch.bincount(client_shard(cfg, k, 2).train.y, minlength=10) for k in range(2)]
    images = sum(sum(images_per_class(c, o.ratio).values()) for c in counts)  # ratio x n_y per class
    assert plan["figures"]["images synthesised"] == images == 2 * 10 * 3  # 2 clients, 10 classes, 1.5 x 2
    per_image = expected_unet_evals(o.steps, o.zigzag_t, 3.0, o.gamma2, spacing=o.spacing)  # gamma1: tiny's 3.0
    synthesis = _terms(plan, "server: synthesis")
    assert sum(t["evals"] for t in synthesis) == images * per_image
    zigzags = (per_image - 2 * o.steps) // 3  # each zigzag step adds an inversion (1 row) and a denoise (2 rows)
    assert sum(t["calls"] for t in synthesis) == math.ceil(images / o.synth_batch) * (o.steps + 2 * zigzags)
    assert {t["rows"] for t in synthesis} <= {2 * 16, 16, 2 * (images % 16), images % 16}  # CFG doubles a batch
    # condition learning: min(J, n_y) = 2 clusters of one image per class, min(embed-batch, 1) row each
    learning = _terms(plan, "client: condition learning")
    assert [(t["rows"], t["calls"]) for t in learning] == [(2 * 10, 2 * o.embed_steps)]
    assert plan["figures"]["conditions per client"] == [20, 20]
    # condition-chunk: the same rows a step in calls of at most 8 (8 + 8 + 4), and the memory at 8 rows
    chunked = make_plan({**ESPRESSO, "prior": prior_dir, "espresso.condition-chunk": 8}, 2, bench=False)
    assert sorted((t["rows"], t["calls"]) for t in _terms(chunked, "client: condition learning")) == [
        (4, 2 * o.embed_steps), (8, 2 * 2 * o.embed_steps)]
    assert chunked["prior"]["unet_memory"]["train_rows"] == 8 and plan["prior"]["unet_memory"]["train_rows"] == 20
    server = _terms(plan, "server classifier")
    assert sum(t["calls"] for t in server) == cfg.server_epochs * math.ceil(images / 64)


def test_fedavg_bytes_are_two_model_transfers_a_round_and_match_a_run(tmp_path):
    from fedapp.models.classifier import build_classifier
    from fedapp.protocols.weights import weights_record
    from fedapp.simulation import simulate_in_process

    flat = {**FEDAVG, "out-dir": str(tmp_path), "run-name": "plan-fedavg"}
    plan = make_plan(flat, 2, bench=False)
    model = weights_record(build_classifier("cnn", 10).state_dict()).count_bytes()  # the packed model
    rounds = FEDAVG["num-server-rounds"]
    for row in plan["comm"]["per_client"].values():
        overhead = row["down"] + row["up"] - 2 * model * rounds  # the run config, metrics, client record
        assert 0 < overhead < 0.01 * 2 * model * rounds
    summary = simulate_in_process(flat, 2)
    assert summary["comm"]["down_bytes"] == plan["comm"]["down_bytes"]
    assert summary["comm"]["up_bytes"] == plan["comm"]["up_bytes"]
    steps = sum(t["calls"] for t in _terms(plan, "local SGD"))
    assert steps == rounds * 2 * math.ceil(30 / FEDAVG.get("batch-size", 16))  # 3 per class x 10 classes


def test_a_tiny_unet_counts_as_many_parameters_as_the_real_module():
    from diffusers import UNet2DConditionModel

    from fedapp.models.prior.tiny import TEST_CONFIG, random_tiny_prior
    from fedapp.plan.arch import PriorArch, parameter_counts

    prior = random_tiny_prior(TEST_CONFIG)
    arch = PriorArch(dict(prior.unet.config), prior.text_encoder.config.to_dict(), None,
                     dict(prior.scheduler.config), "test")
    real = UNet2DConditionModel.from_config(dict(prior.unet.config))
    assert parameter_counts(arch)["unet"] == sum(p.numel() for p in real.parameters())
    assert parameter_counts(arch)["text"] == sum(p.numel() for p in prior.text_encoder.parameters())


def test_sd15_sized_configs_count_on_the_meta_device_without_allocating():
    """SD-1.5's UNet (block_out_channels 320..1280, cross-attention 768): 859.5 M parameters, 3.4 GB in float32;
    counted, profiled at a synthesis batch and at a condition-learning batch in a fresh process whose peak
    memory stays far below one copy of the weights."""
    code = (
        "import resource, json\n"
        "from fedapp.plan.arch import shipped_arch, parameter_counts, meta_module\n"
        "from fedapp.plan.footprint import unet_footprint\n"
        "import diffusers, transformers\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "arch = shipped_arch('runwayml/stable-diffusion-v1-5')\n"
        "unet = meta_module('unet', arch.unet)\n"
        "meta = all(p.is_meta for p in unet.parameters())\n"
        "out = {'counts': parameter_counts(arch), 'foot': unet_footprint(arch, 16, 2), 'meta': meta,\n"
        "       'grew_kb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before}\n"
        "print(json.dumps(out))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["meta"] and round(out["counts"]["unet"] / 1e6, 1) == 859.5
    assert out["foot"]["weight_bytes"] == 4 * out["counts"]["unet"] and out["foot"]["infer_activation_bytes"] > 0
    assert out["grew_kb"] * 1024 < 0.1 * out["foot"]["weight_bytes"]  # < 340 MB against 3.4 GB of weights


def test_a_hub_prior_not_cached_plans_from_its_shipped_configs_or_as_stable_diffusion_15():
    from fedapp.plan.arch import parameter_counts, prior_arch

    arch = prior_arch("no-such-owner/no-such-pipeline", None)
    assert "Stable Diffusion 1.5" in arch.source and arch.image_size == 512 and arch.latent_shape == (4, 64, 64)
    assert arch.cond_shape == (77, 768) and arch.num_up_blocks == 4
    sd21 = prior_arch("stabilityai/stable-diffusion-2-1", None)  # 768 px, 1024-wide text states
    assert "Stable Diffusion 2.1" in sd21.source and sd21.image_size == 768 and sd21.cond_shape == (77, 1024)
    assert round(parameter_counts(sd21)["unet"] / 1e6, 1) == 865.9


def test_sampler_calls_sum_to_the_samplers_own_count():
    from types import SimpleNamespace

    from fedapp.models.prior.samplers import expected_unet_evals
    from fedapp.plan.arch import shipped_arch
    from fedapp.plan.counts import sampler_calls

    arch = shipped_arch("runwayml/stable-diffusion-v1-5")
    for sampler, steps, g1, g2, conv, spacing in [("zigzag", 10, 7.5, 0.0, "paper", "trailing"),
                                                  ("zigzag", 25, 7.5, 1.0, "official", "leading"),
                                                  ("ddim", 50, 1.0, 0.0, "paper", "leading")]:
        opts = SimpleNamespace(steps=steps, spacing=spacing, gamma1=g1, gamma2=g2, zigzag_t=800, zigzag=conv,
                               sampler=sampler)
        expected = expected_unet_evals(steps, 800 if sampler == "zigzag" else None, g1, g2, 1000, 1, spacing, conv)
        assert sum(sampler_calls(opts, arch)) == expected


def test_every_registered_method_has_a_cost_model():
    from fedapp import registry

    assert set(COUNTERS) == set(registry.METHODS)
    for method in registry.METHODS:
        counters_of(method)


def test_a_preset_toml_and_pairs_read_as_flwr_run_reads_them(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('method = "espresso"\n[espresso]\nsteps = 50\nsampler = "ddim"\n')
    assert read_run_config([str(preset), "espresso.steps=20", "seed=1"]) == {
        "method": "espresso", "espresso.steps": 20, "espresso.sampler": "ddim", "seed": 1}


@pytest.mark.parametrize("args, named", [
    (["espresso.ratio=-1"], "espresso.ratio=-1"),
    (["method=nope"], "method='nope'"),
    (["espresso.stepz=3"], "espresso.stepz=3"),
    (["espresso.steps"], "'espresso.steps'"),
    (["missing.toml"], "missing.toml"),
    (["prior=./no/such/folder"], "prior='./no/such/folder'"),
    (["--num-clients", "0"], "--num-clients=0"),
])
def test_bad_input_is_one_clear_line_naming_the_key(args, named, capsys):
    from fedapp.plan.__main__ import main

    assert main([*args, "--no-bench"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err


def test_the_cli_prints_a_table_and_json(capsys, prior_dir):
    from fedapp.plan.__main__ import main

    args = [f"{k}={json.dumps(v)}" for k, v in {**ESPRESSO, "prior": prior_dir}.items()]
    assert main([*args, "--num-clients", "2", "--no-bench", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["run"]["num_clients"] == 2 and plan["prior"]["parameters"]["unet"] > 0
    assert main([*args, "--num-clients", "2", "--budget", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "server: synthesis UNet calls" in out and "projected:" in out and "total: down" in out


def test_the_gpu_check_plans_presets_on_its_device(tmp_path):
    """benchmarks/gpu_check.py --plan: each preset's plan timed on the check's device (here the CPU), a preset
    that cannot be planned recorded with its reason."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_check

    out = tmp_path / "gpu_check.json"
    preset = " ".join(f"{k}={json.dumps(v)}" for k, v in {**FEDAVG, "num-server-rounds": 1}.items())
    gpu_check.main(["--device", "cpu", "--plan-only", "--plan", preset, "method=nope", "--plan-clients", "2",
                    "--out", str(out)])
    plans = json.loads(out.read_text())["plans"]
    assert plans["method=nope"]["error"].startswith("method='nope'")
    ok = plans[preset]
    assert ok["run"]["device"] == "cpu" and ok["totals"]["wall_seconds_in_process"] > 0
    assert {t["module"] for t in ok["terms"]} == {"classifier"} and all(t["seconds"] > 0 for t in ok["terms"])


def test_a_preset_whose_data_is_not_here_plans_on_assumed_data_and_says_what_the_run_would_refuse():
    plan = make_plan({"method": "espresso", "dataset": "no-such-owner/no-such-data", "prior":
                      "runwayml/stable-diffusion-v1-5", "min-clients": 4}, bench=False, assume=(7, 112))
    # the assumption is all it says: 512 px is a size feddata decodes a hub dataset at (a batch at a time)
    assert len(plan["refusals"]) == 1 and plan["refusals"][0].startswith("ASSUMED data")
    assert plan["run"]["image_size"] == 512 and plan["figures"]["images synthesised"] == 4 * 7 * 5 * 16
    assert plan["figures"]["conditions per client"] == [28] * 4  # J = 4 clusters for each of 7 classes
    assert plan["prior"]["parameters"]["unet"] == 859_520_964
    upload = [r for r in plan["comm"]["by_phase"] if (r["phase"], r["direction"]) == ("train", "up")][0]
    assert upload["bytes"] > 4 * 28 * 77 * 768 * 4  # the conditions alone: (E, 77, 768) float32 a client
