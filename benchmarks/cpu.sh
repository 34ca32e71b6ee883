#!/usr/bin/env bash
# The CPU side by side, in one run: llama.cpp (llama-cpp-python, 2 threads), mlxllama native and
# mlxllama --dequantize (float32, MLX's CPU default) on the TinyLlama-shape Q4_K_M file, then a decode profile.
#   bash benchmarks/cpu.sh OUT_DIR [P N R]      (defaults 32 8 3: full pp512/tg128 take hours on 2 slow cores)
# PYTHON is the interpreter with mlxllama installed (default python3); LLAMA_CPP_PYTHON one with
# llama-cpp-python (default $PYTHON; docs/maintaining.md says how to build it on this kind of machine).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1 p=${2:-32} n=${3:-8} r=${4:-3}
python=${PYTHON:-python3}
reference=${LLAMA_CPP_PYTHON:-$python}
mkdir -p "$out"
model=$out/tinyllama-1.1b-Q4_K_M.gguf
[ -f "$model" ] || "$python" -c "from mlxllama import synthetic; synthetic.write('$model')"
"$reference" benchmarks/llama_cpp_bench.py "$model" -p "$p" -n "$n" -r "$r" --json "$out/llama-cpp.json"
for mode in native dequantize; do
    flag=$([ $mode = dequantize ] && echo --dequantize || true)
    "$python" -m mlxllama bench -m "$model" -p "$p" -n "$n" -r "$r" $flag --json > "$out/mlxllama-$mode.json"
    "$python" benchmarks/profile_decode.py "$model" $flag --context "$p" --reps 2 --json "$out/profile-$mode.json"
done
