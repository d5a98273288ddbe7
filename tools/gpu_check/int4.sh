#!/usr/bin/env bash
# The follow-up device check of an int4 cache hit on a GPU (torch's CUDA int4 product on the layout the copy's
# landing makes): its CUDA tests, the kernel beside the others, the lossless matrix in int4, and bench live in int4.
# Same carried folders and set-up as check.sh:  bash tools/gpu_check/int4.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
for w in .whl/*.whl; do
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" >/dev/null 2>&1
done
export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD
echo "=== pytest -m gpu tests/test_cache_cuda.py ==="
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cache_cuda.py -o addopts="" -rA 2>&1 \
  | tee "$OUT/pytest.txt" | tail -8
echo "=== packed kernels ==="
timeout 50 python3 tools/gpu_check/packed_kernels.py 2>&1 | tee "$OUT/packed.txt" | grep -E "int4|bf16 dense|Error"
echo "=== lossless, int4 ==="
timeout 60 python3 tools/gpu_check/lossless.py --formats int4 --deadline-s 45 2>&1 | grep -v -E "Loading|Writing" \
  | tee "$OUT/lossless.txt" | tail -20
live() {  # NAME SECONDS
  echo "=== bench live --synthetic $1 --layers 4 --expert-format int4 ==="
  timeout "$2" python3 -m fmoe_bench.cli live --synthetic "$1" --layers 4 --expert-format int4 \
    --trace .gpu/data/traces/deepseek-v2-lite-intent.npz --policies fmoe,lru,on_demand,cpu_moe \
    --miss-handling copy,auto --requests 3 --max-new-tokens 16 --device cuda --json "$OUT/live_$1_int4.json" 2>&1 \
    | grep -v -E "Loading weights|Writing model" | tee -a "$OUT/live.txt" | tail -14
}
live qwen3-30b-a3b 60
live mixtral-8x7b 90
echo "=== done ==="
