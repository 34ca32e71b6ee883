#!/usr/bin/env bash
# GPU session, call 6 (right after gpu_run.sh, on the same machine): once the llama.cpp build started by
# call 1 is done and the machine is quiet, benchmark the TinyLlama-shape Q4_K_M file side by side:
# mlxllama native (with and without the CUDA decode kernels) and --dequantize (float16), then llama.cpp's llama-bench and llama-batched-bench
# (CUDA, every layer on the GPU) on the same file. Call 7 runs decode_variants.py and op_cost.py.
#   set -o pipefail; bash benchmarks/gpu_bench.sh 2>&1 | tee $OUT/gpu_bench_log.txt
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
model=/tmp/gpu/tinyllama-1.1b-Q4_K_M.gguf
log() { echo "=== $* ($(date +%T), ${SECONDS}s)"; }

log waiting for the llama.cpp build
while [ ! -f /tmp/gpu/llama-build.done ] && pgrep -f build_llama_cpp > /dev/null; do sleep 5; done
tail -2 /tmp/gpu/build.log

# native: decoding (1, 8 and 16 sequences) goes through cuda_step.py's kernels; plain: the same
# model through the plain MLX step; dequantize: every weight float16.
for mode in native plain dequantize; do
    log mlxllama bench $mode
    flag=$([ $mode = dequantize ] && echo --dequantize)
    kernels=$([ $mode = plain ] && echo 0 || echo 1)
    MLXLLAMA_CUDA_KERNELS=$kernels timeout 150 python3 cli.py bench -m "$model" -p 512 -n 128 -b 1,8,16 -r 5 $flag \
        --json > "$OUT/mlx_$mode.json"
    python3 -c "import json; r = json.load(open('$OUT/mlx_$mode.json')); print('$mode', round(r['load_seconds'], 2), 's',
        round(r['weight_ratio'], 3), [(t['name'], t['batch'], round(t['tokens_per_second'], 1), round(t['stdev'], 1)) for t in r['tests']])"
    MLXLLAMA_CUDA_KERNELS=$kernels timeout 60 python3 benchmarks/profile_decode.py "$model" $flag --context 512 \
        --json "$OUT/profile_$mode.json"
done
log kernel trace
timeout 120 python3 benchmarks/kernel_trace.py "$model" --json "$OUT/trace_native.json" | head -7

if [ -f /tmp/gpu/llama-build.done ]; then
    export LD_LIBRARY_PATH=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
    bin=/tmp/gpu/llama-build/bin
    log llama-bench
    timeout 120 "$bin/llama-bench" -m "$model" -p 512 -n 128 -r 5 -ngl 99 -fa off,on -o json > "$OUT/llama_bench.json"
    python3 -c "import json; [print(r['n_prompt'], r['n_gen'], r['flash_attn'], round(r['avg_ts'], 1), round(r['stddev_ts'], 1)) for r in json.load(open('$OUT/llama_bench.json'))]"
    log llama-batched-bench
    timeout 60 "$bin/llama-batched-bench" -m "$model" -c 4096 -b 2048 -ub 512 -npp 1 -ntg 128 -npl 1,8,16 -ngl 99 -fa on \
        2>&1 | grep "^|"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
log done
