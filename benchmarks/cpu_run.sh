#!/usr/bin/env bash
# The CPU side by side, in one run: llama.cpp (llama-cpp-python, 2 threads), mlxllama native and
# mlxllama --dequantize (float32, MLX's CPU default) on the TinyLlama-shape Q4_K_M file, then a decode profile.
#   bash benchmarks/cpu_run.sh OUT_DIR [P N R]      (defaults 32 8 3: full pp512/tg128 take hours on 2 slow cores)
# Needs /work/refvenv (llama-cpp-python) and the project venv /work/venv.
set -euo pipefail
out=$1 p=${2:-32} n=${3:-8} r=${4:-3}
mkdir -p "$out"
model=$out/tinyllama-1.1b-Q4_K_M.gguf
[ -f "$model" ] || /work/venv/bin/python -c "from mlxllama import synthetic; synthetic.write('$model')"
/work/refvenv/bin/python benchmarks/llama_cpp_bench.py "$model" -p "$p" -n "$n" -r "$r" --json "$out/llama_cpp.json"
for mode in native dequantize; do
    flag=$([ $mode = dequantize ] && echo --dequantize || true)
    /work/venv/bin/mlxllama bench -m "$model" -p "$p" -n "$n" -r "$r" $flag --json > "$out/mlx_$mode.json"
    /work/venv/bin/python benchmarks/profile_decode.py "$model" $flag --context "$p" --reps 2 --json "$out/profile_$mode.json"
done
