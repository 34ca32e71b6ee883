#!/usr/bin/env bash
# GPU session, call 5 (after gpu_stash.sh p1..p4): install MLX (CUDA), make the TinyLlama-shape Q4_K_M file
# and run the parity, native-mode and generation tests on the GPU while the llama.cpp build started by
# call 1 goes on. Call 6 is gpu_bench.sh.
#   set -o pipefail; bash benchmarks/gpu_run.sh .whl/p5 2>&1 | tee $OUT/gpu_log.txt
set -uo pipefail
parts=$1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
model=/tmp/gpu/tinyllama-1.1b-Q4_K_M.gguf
log() { echo "=== $* ($(date +%T), ${SECONDS}s)"; }

log install MLX
mkdir -p /tmp/site
cat /tmp/gpu/mlx.part0[0-3] "$parts"/mlx.part04 | xz -d | tar x -C /tmp/site || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$parts"/gguf-*.whl || exit 1
python3 -c 'import mlx.core as mx; print(mx.__version__, mx.default_device(), mx.device_info())' || exit 1
python3 -c "from mlxllama import synthetic; synthetic.write('$model')"

log checks on the GPU: decoders, native mode, compiled step, parity with llama.cpp in float16
timeout 420 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_native_quant.py tests/test_llama_parity.py \
    tests/test_generation.py tests/test_cuda_step.py -k "not tokenization" 2>&1 | grep -v "^E  \|^    \|^$" | tail -25

tail -2 /tmp/gpu/build.log
log done
