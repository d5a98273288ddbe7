#!/usr/bin/env bash
# Session 16's device check: the CUDA tests (cache.py's slots were rewritten onto slot_table.SlotTable after the last
# lease), then where a live run's time goes between threads, and what the GIL switch interval does to it
# (tools/gpu_check/thread_time.py): the matcher on its own thread or on the forward thread (MODES), under the
# default switch interval (INTERVALS, ms). PYTEST=0 skips the tests; REPLAY=1 times the matcher alone on this host
# (.gpu/ovh/calls.pkl from `tools/gpu_check/matcher_calls.py record`). Same carried folders and set-up as check.sh:  bash tools/gpu_check/threads.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export FMOE_SHARED_DATA=$PWD/.gpu/data
for w in .whl/*.whl; do
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" >/dev/null 2>&1
done
export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
[ "${PYTEST:-1}" = 1 ] && timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cache_cuda.py tests/test_loading.py \
  -o addopts="" -rA >"$OUT/pytest.txt" 2>&1 &
TESTS=$!
echo "=== qwen3-30b-a3b, 16 layers ==="
timeout "${QWEN_S:-150}" python3 tools/gpu_check/thread_time.py --shape qwen3-30b-a3b --layers 16 \
  --policies fmoe,lru --miss-handling copy,auto \
  --modes "${MODES:-threaded,inline}" --intervals-ms "${INTERVALS:-5}" 2>&1 | grep -v -E "Loading weights|Writing model" | tee "$OUT/qwen3.txt"
wait $TESTS; echo "=== pytest exit $? ==="; tail -22 "$OUT/pytest.txt"
echo "=== mixtral-8x7b, 8 layers ==="
timeout "${MIXTRAL_S:-130}" python3 tools/gpu_check/thread_time.py --shape mixtral-8x7b --layers 8 \
  --policies fmoe,lru --miss-handling copy \
  --modes "${MODES:-threaded,inline}" --intervals-ms "${INTERVALS:-5}" 2>&1 | grep -v -E "Loading weights|Writing model" | tee "$OUT/mixtral.txt"
if [ "${REPLAY:-0}" = 1 ]; then echo "=== the matcher alone ==="; python3 tools/gpu_check/matcher_calls.py replay .gpu/ovh/calls.pkl; fi
echo "=== done ==="
