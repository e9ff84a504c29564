"""The GPU check, prepared to run in one go on a CUDA machine (about 3-5 minutes on one GPU):

    python benchmarks/gpu_check.py                 # CUDA: SD-layout prior at 64 px, 4 clients share the GPU
    python benchmarks/gpu_check.py --device cpu --image-size 32 --per-class 2   # a dry run of the script on CPU

1. Builds an SD-1.5-layout prior with random weights at `--image-size` (VAE with 8x downsampling at 64 px:
   8x8x4 latents; fedapp.models.prior.sd_layout) and saves it with save_pretrained.
2. Times one sampler batch (25 DDIM steps, guided) on the CPU and on the device: the device/CPU ratio.
3. Runs the default experiment (Espresso, digit-styles, domain partitioner, 4 clients) with that prior
   through fedapp.simulate, 4 virtual clients sharing one GPU (backend num_gpus = 0.25 each), while a
   thread polls nvidia-smi for each process's GPU memory.
4. Prints wall time per phase, synthesis images/s and the peak GPU memory of each process (the Ray
   actors and the server), and writes them to --out as JSON.
Timing does not depend on the prior's weights; accuracy with a random prior is meaningless and not
reported as a result.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def time_sampler(folder: Path, device: str, batch: int, steps: int) -> float:
    """Seconds for one guided DDIM batch (median of 3 after a warm-up)."""
    import statistics

    import torch

    from fedapp.models.prior import load_prior

    prior = load_prior(folder, device=device)
    noise = torch.randn(batch, *prior.latent_shape, generator=torch.Generator().manual_seed(0))
    prior.sample(noise, "a photo of the digit three", num_steps=steps)  # warm-up (CUDA kernels, caches)
    times = []
    for _ in range(3):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        prior.sample(noise, "a photo of the digit three", num_steps=steps)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run of the script")
    ap.add_argument("--image-size", type=int, default=64, help="pixels per side of the SD-layout prior (64: 8x VAE)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--gpus-per-client", type=float, default=0.25)
    ap.add_argument("--per-class", type=int, default=16, help="training images per class per client")
    ap.add_argument("--batch", type=int, default=64, help="images in the timed sampler batch")
    ap.add_argument("--steps", type=int, default=25, help="DDIM steps of the timed sampler batch")
    ap.add_argument("--out", default="docs/results/gpu_check.json")
    a = ap.parse_args(argv)

    import torch

    import fedapp
    from fedapp.models.prior.sd_layout import random_sd_pipeline

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; run it on a GPU machine (or --device cpu for a dry run)")
    levels = {32: 2, 64: 4}.get(a.image_size, 2)  # 64 px: 8x downsampling, as SD's VAE
    work = Path(tempfile.mkdtemp(prefix="fedapp-gpu-check-"))
    try:
        random_sd_pipeline(work, image_size=a.image_size, levels=levels).save_pretrained(work / "prior")
        cpu_s = time_sampler(work / "prior", "cpu", a.batch, a.steps)
        dev_s = time_sampler(work / "prior", a.device, a.batch, a.steps) if a.device != "cpu" else cpu_s
        poller = GpuMemoryPoller()
        if a.device.startswith("cuda"):
            poller.start()
        gpus = a.gpus_per_client if a.device.startswith("cuda") else 0.0
        t0 = time.time()
        summary = fedapp.simulate(
            {"method": "espresso", "prior": str(work / "prior"), "device": a.device,
             "partitioner.per-class": a.per_class, "min-clients": a.clients, "out-dir": str(work / "runs")},
            num_clients=a.clients, backend={"client_resources": {"num_cpus": 1, "num_gpus": gpus}})
        wall = time.time() - t0
        poller.stop.set()
        m = summary["metrics"]
        synth = summary["phase_seconds"].get("synthesis", float("nan"))
        result = {
            "device": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu",
            "image_size": a.image_size, "latent_shape": [4] + [a.image_size // 2 ** (levels - 1)] * 2,
            "sampler_batch": {"batch": a.batch, "steps": a.steps, "cpu_seconds": round(cpu_s, 3),
                              "device_seconds": round(dev_s, 3), "cpu_over_device": round(cpu_s / dev_s, 2)},
            "experiment": {"clients": a.clients, "gpus_per_client": gpus, "status": summary["status"],
                           "wall_seconds": round(wall, 1), "phase_seconds": summary["phase_seconds"],
                           "num_synthetic": m.get("num_synthetic"),
                           "synthesis_images_per_second": round(m.get("num_synthetic", 0) / synth, 1)},
            "peak_gpu_memory_mib_per_process": poller.peak,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"sampler batch {a.batch} x {a.steps} steps: CPU {cpu_s:.2f} s, {a.device} {dev_s:.2f} s "
          f"-> {cpu_s / dev_s:.1f}x")
    print(f"espresso, {a.clients} clients x {gpus} GPU: {result['experiment']['wall_seconds']} s wall, "
          f"synthesis {result['experiment']['synthesis_images_per_second']} img/s")
    for phase, sec in summary["phase_seconds"].items():
        print(f"  {phase:<12} {sec:8.1f} s")
    for pid, mib in sorted(poller.peak.items()):
        print(f"  pid {pid}: peak {mib} MiB")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
