#!/bin/bash
# One device call's worth of GPU work (~8 min on an H200), prepared so that a session lent a GPU runs it in one
# go. Here, first: `python benchmarks/gpu_wheels.py --out .whl` (with `/.whl/` in .git/info/exclude); then the
# device tool's run with carry [".whl"] and the command `bash benchmarks/gpu_session.sh`. Everything it measures
# lands in $OUT (at most 8 files come back): nvidia.txt, gpu_check.{json,log}, pfdm_budget.log and the 28 px
# pfdm-budget sweep's json and png.
#   1. benchmarks/gpu_check.py --in-process (capped at GPU_CHECK_S seconds): the SD-1.5-size UNet batch, the
#      default Espresso experiment, one round of each other method, on the GPU.
#   2. issue 27 item 1 at 28 px: centralized-ddpm's step sweep on colored-mnist (capped at PFDM_BUDGET_S; the
#      json keeps every checkpoint read before the cap, and its state and json continue from /tmp/pb on a warm
#      machine: GPU_CHECK_S=1 skips the check on such a second call).
set -u
OUT=${OUT:?set OUT to the folder results go to}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
       MPLBACKEND=Agg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_session: installing .whl failed"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia.txt"
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))" \
    | tee -a "$OUT/nvidia.txt"

timeout "${GPU_CHECK_S:-270}" python3 benchmarks/gpu_check.py --in-process --out "$OUT/gpu_check.json" \
    > "$OUT/gpu_check.log" 2>&1
echo "gpu_check: exit $?"
grep -v "INFO\|WARNING" "$OUT/gpu_check.log" | tail -30

timeout "${PFDM_BUDGET_S:-200}" python3 -m experiments pfdm-budget --dataset colored-mnist --image-size 28 --seeds 0 \
    --channels 32,64 --ema 0.999 --p-uncond 0.1 --guidance 1,2 \
    --steps 2000,4000,6000,8000,10000,12000,14000,16000,20000,24000 --threads 8 --out /tmp/pb/out --runs-dir /tmp/pb \
    > "$OUT/pfdm_budget.log" 2>&1
echo "pfdm-budget: exit $?"
# the json lives beside the training state, not in $OUT (empty at every call): a call on a warm machine continues
# the sweep and keeps the readings of the calls before it
cp /tmp/pb/out/pfdm_budget_* "$OUT"/ 2>/dev/null
grep -v "INFO" "$OUT/pfdm_budget.log" | tail -20
