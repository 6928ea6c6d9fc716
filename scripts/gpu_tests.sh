#!/usr/bin/env bash
# GPU test run on the lent machine: bash scripts/gpu_tests.sh [pytest -k expression]
# Results (JSON evidence, server logs) go to $OUT when set, else ./gpu-results.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_setup.sh
export DFLASH_TINY_DIR=${DFLASH_TINY_DIR:-/tmp/dflash-tiny} DFLASH_GPU_RESULTS=${OUT:-$PWD/gpu-results}
[ -f "$DFLASH_TINY_DIR/draft/model.safetensors" ] || python3 scripts/make_tiny_pair.py "$DFLASH_TINY_DIR" > /dev/null 2>&1
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider ${1:+-k "$1"} 2>&1 | grep -vE "it/s\]|s/it\]" | tee "$DFLASH_GPU_RESULTS/pytest.log"
