#!/usr/bin/env bash
# GPU session, follow-up call 5 (after the four MLX parts are in /tmp/gpu; no llama.cpp needed): the
# parity and native-mode tests on the GPU (float16) for every fixture in the repository, then MLX's
# matmul paths by rows and the dispatch sweep on the TinyLlama-shape file.
#   set -o pipefail; bash benchmarks/gpu_check.sh .whl/p5 2>&1 | tee $OUT/gpu_log.txt
set -uo pipefail
parts=$1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
model=/tmp/gpu/tinyllama-1.1b-Q4_K_M.gguf
log() { echo "=== $* ($(date +%T), ${SECONDS}s)"; }
log install MLX
mkdir -p /tmp/site
cat /tmp/gpu/mlx.part0[0-3] "$parts"/mlx.part04 | xz -d | tar x -C /tmp/site || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$parts"/gguf-*.whl || exit 1
python3 -c "from mlxllama import synthetic; synthetic.write('$model')"
log tests on the GPU
timeout 330 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_native_quant.py tests/test_llama_parity.py \
    2>&1 | grep -v "^E  \|^    \|^$" | tail -25
log matmul paths
timeout 150 python3 benchmarks/matmul_paths.py --json "$OUT/matmul_paths.json"
log dispatch sweep
timeout $((585 - SECONDS)) python3 benchmarks/dispatch_sweep.py "$model" --json "$OUT/dispatch_sweep.json"
log done
