#!/usr/bin/env bash
# The device check of ../shared/GPU.md as one script, for the `device` tool's lent GPU machine (bare image with
# CUDA PyTorch, no network). Run from the repository root with .whl (wheels + an unpacked bitsandbytes under
# .whl/site) and .gpu/data (a copy of shared/data's prompts and one trace) carried:
#   bash tools/gpu_check/check.sh
# Preparing them here (both folders are git-ignored; the device image's Python is 3.12 with its own torch):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl transformers==5.23.0 platformdirs regex
#   pip download ... --platform manylinux_2_24_x86_64 -d /tmp/bnb bitsandbytes; unzip it into .whl/site and delete
#     every libbitsandbytes_*.so but _cpu and the image's CUDA (cuda130): the carried tree must stay under 64 MB
#   mkdir -p .gpu/data/traces; cp -r ../shared/data/prompts .gpu/data/
#   cp ../shared/data/traces/deepseek-v2-lite-intent.npz .gpu/data/traces/
# Each section has its own time limit inside BUDGET_S so that a hang in one leaves the others their results; logs
# go to $OUT (at most 8 files come back).
set -uo pipefail
BUDGET_S=${BUDGET_S:-470}
START=$(date +%s)
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 GRADIO_ANALYTICS_ENABLED=False
export FMOE_SHARED_DATA=$PWD/.gpu/data TOKENIZERS_PARALLELISM=false

left() { echo $((BUDGET_S - ($(date +%s) - START))); }
# limit SECONDS: the smaller of SECONDS and what the budget has left (at least 5)
limit() { local l; l=$(left); l=$((l < $1 ? l : $1)); echo $((l > 5 ? l : 5)); }
section() { echo; echo "=== $1 (t=$(($(date +%s) - START)) s, $(left) s left) ==="; }

section "set-up" | tee "$OUT/env.txt"
for w in .whl/*.whl; do  # one at a time: a wheel this Python cannot take must not keep the others out
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" \
    >>"$OUT/env.txt" 2>&1 || echo "could not install $w" | tee -a "$OUT/env.txt"
done
export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD

{
  section "1. machine"
  nvidia-smi
  nproc; free -g | head -2
  python3 - <<'EOF'
import time, torch, transformers
print("torch", torch.__version__, "CUDA", torch.version.cuda, "transformers", transformers.__version__)
print("GPU", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))
from fmoe_local.bandwidth import host_to_device_gbps, dram_read_gbps
print(f"fmoe_local.bandwidth.host_to_device_gbps (pinned, 256 MB x3): {host_to_device_gbps():.1f} GB/s")
for pinned in (True, False):
    for mb in (32, 352, 1024):
        n = mb * 1_000_000
        host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        dev.copy_(host, non_blocking=pinned); torch.cuda.synchronize()
        reps = 5
        t = time.perf_counter()
        for _ in range(reps):
            dev.copy_(host, non_blocking=pinned)
        torch.cuda.synchronize()
        print(f"host->device {'pinned  ' if pinned else 'pageable'} {mb:5d} MB: {n * reps / (time.perf_counter() - t) / 1e9:6.1f} GB/s")
print(f"DRAM read (fmoe_local.bandwidth.dram_read_gbps): {dram_read_gbps():.1f} GB/s")
EOF
} 2>&1 | tee -a "$OUT/env.txt"

section "2. pytest -m gpu  ||  3. lossless matrix on the GPU (in parallel: tiny models)"
timeout "$(limit 170)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cache_cuda.py tests/test_loading.py \
  -o addopts="" --timeout 150 -rA >"$OUT/pytest.txt" 2>&1 &
PYTEST=$!
timeout "$(limit 170)" python3 tools/gpu_check/lossless.py --deadline-s 130 >"$OUT/lossless.txt" 2>&1 &
LOSSLESS=$!
wait $PYTEST; echo "pytest exit $?"
tail -25 "$OUT/pytest.txt"
wait $LOSSLESS; echo "lossless exit $?"
grep -v -E "Loading weights|Writing model" "$OUT/lossless.txt" | tail -60

section "3b. GPT-OSS's eager attention in pieces against one whole call"
timeout "$(limit 40)" python3 tools/gpu_check/attention_pieces.py 2>&1 | grep -v -E "Loading weights|Writing model" \
  | tee -a "$OUT/lossless.txt"

section "5. packed experts on the GPU"
timeout "$(limit 90)" python3 tools/gpu_check/packed_kernels.py >"$OUT/packed.txt" 2>&1
echo "exit $?"
tail -30 "$OUT/packed.txt"

live() {  # NAME LAYERS FORMAT MISS-HANDLING SECONDS
  section "4. bench live --synthetic $1 --layers $2 --expert-format $3 --miss-handling $4"
  timeout "$(limit "$5")" python3 -m fmoe_bench.cli live --synthetic "$1" --layers "$2" --expert-format "$3" \
    --trace .gpu/data/traces/deepseek-v2-lite-intent.npz --policies fmoe,lru,on_demand,cpu_moe \
    --miss-handling "$4" --requests 3 --max-new-tokens 16 --device cuda \
    --json "$OUT/live_$1_$2_$3.json" 2>&1 | grep -v -E "Loading weights|Writing model" | tee -a "$OUT/live.txt" | tail -22
  echo "exit ${PIPESTATUS[0]}"
}
# Session 13 ran 4 layers (d = 3 of 4: prefetches mostly aim at the next token); 16 layers is the next check.
live qwen3-30b-a3b 16 bf16 copy,cpu,auto 150
live qwen3-30b-a3b 4 int4 copy,auto 70  # int4 hits through torch's CUDA int4 product (Int4CudaWeight)
live mixtral-8x7b 8 bf16 copy,auto 120
section "done"
