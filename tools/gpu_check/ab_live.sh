#!/usr/bin/env bash
# A/B of `bench live --synthetic` on the lent GPU: a copy of an earlier fmoe_local (BASE, a folder holding
# fmoe_local/, and fmoe_bench/ when it is from after the split; else this checkout's bench drives it) against this
# checkout's, interleaved on the same machine, after the CUDA tests and the copy-only lossless runs of this checkout.
# Same carried paths as check.sh; run from the repository root:
#   BASE=.gpu/base bash tools/gpu_check/ab_live.sh
# SHAPES (default "mixtral-8x7b qwen3-30b-a3b"), POLICIES (default fmoe,lru,on_demand) and LOSSLESS=0 (skip the
# lossless runs) fit it to the device time left.
set -uo pipefail
BUDGET_S=${BUDGET_S:-420}
BASE=$(cd "${BASE:?set BASE to a folder holding the earlier fmoe_local}" && pwd)
START=$(date +%s)
REPO=$PWD
OUT=${OUT:-/tmp/gpu_ab_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export FMOE_SHARED_DATA=$PWD/.gpu/data
TRACE=$PWD/.gpu/data/traces/deepseek-v2-lite-intent.npz
left() { echo $((BUDGET_S - ($(date +%s) - START))); }
limit() { local l; l=$(left); l=$((l < $1 ? l : $1)); echo $((l > 5 ? l : 5)); }
section() { echo; echo "=== $1 (t=$(($(date +%s) - START)) s, $(left) s left) ==="; }

for w in .whl/*.whl; do
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" \
    >/dev/null 2>&1 || echo "could not install $w"
done
export PYTHONPATH=/tmp/site:$PWD/.whl/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

section "CUDA tests and copy-only lossless runs of this checkout"
(PYTHONPATH=$PYTHONPATH:$PWD timeout "$(limit 90)" python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
  --timeout 80 tests/test_cache_cuda.py tests/test_loading.py 2>&1 | tail -4) &
TESTS=$!
if [ "${LOSSLESS:-1}" = 1 ]; then
  PYTHONPATH=$PYTHONPATH:$PWD timeout "$(limit 90)" python3 tools/gpu_check/lossless.py --deadline-s 60 \
    --families mixtral,deepseek_v3,gpt_oss 2>&1 | grep -v -E "Loading weights|Writing model" | tail -18
fi
wait $TESTS

live() {  # WHICH DIR NAME FORMAT MISSES SECONDS
  section "$1: bench live --synthetic $3 --expert-format $4 --miss-handling $5"
  (cd "$2" && PYTHONPATH="$PYTHONPATH:$REPO" timeout "$(limit "$6")" python3 -m fmoe_bench.cli live --synthetic "$3" --layers 4 \
    --expert-format "$4" --trace "$TRACE" --policies "${POLICIES:-fmoe,lru,on_demand}" --miss-handling "$5" --requests 3 \
    --max-new-tokens 16 --device cuda --json "$OUT/$1_$3_$4.json" 2>&1) | grep -v -E "Loading weights|Writing model" \
    | tee -a "$OUT/live.txt" | tail -10
}
for shape in ${SHAPES:-mixtral-8x7b qwen3-30b-a3b}; do
  live base "$BASE" "$shape" bf16 copy,auto 100
  live new "$PWD" "$shape" bf16 copy,auto 100
done
section "done"
