"""What a ClientApp process imports before its first message: every deployed message starts one
(benchmarks/deployed_message.py), so modules no handler of the method needs stay unloaded."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the prior's pipeline, the tiny prior's code and shipping load with the first prior a handler uses; the data
# packages with the first shard built (a deployed node reads its kept shard: fedapp.shard_cache)
NOT_AT_IMPORT = ("fedapp.models.prior.pipeline", "fedapp.models.prior.tiny", "fedapp.models.prior.shipping",
                 "fedapp.models.prior.spec", "diffusers", "transformers", "sklearn", "flwr_datasets", "datasets",
                 "strategies", "clients")


def test_importing_the_client_app_loads_no_method_code_and_no_data_package():
    code = ("import sys, fedapp.client_app\n"
            f"print(sorted(m for m in sys.modules if m.startswith({NOT_AT_IMPORT!r})))\n"
            "from fedapp.models.prior import Prior, load_or_build_prior\n"  # the package's names still load on use
            "print(Prior.__module__, load_or_build_prior.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         timeout=600).stdout.split("\n")
    assert out[0] == "[]"
    assert out[1] == "fedapp.models.prior.pipeline fedapp.models.prior.spec"
