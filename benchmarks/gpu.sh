#!/usr/bin/env bash
# MLX's CUDA build on a lent GPU machine (the workplace's device tool), in a few calls; docs/benchmarks.md
# and docs/maintaining.md give the calls in order.
#
#   bash benchmarks/gpu.sh payload [--llama-cpp] [--gemma] [--fixtures] [--mlx-lm]
#                                                 # here: .whl/p1.. (git-ignored): MLX 0.32.4 for CUDA 13 and the
#                                                 # gguf, starlette and uvicorn wheels (the rest is
#                                                 # in the machine's image), xz-compressed and split in parts of what 64 MiB less the tree leaves, so that
#                                                 # each call carries one part beside the repository (64 MiB a call);
#                                                 # --llama-cpp adds llama.cpp's source (llama-cpp-python 0.3.36's)
#                                                 # as .whl/l1 .. (stash them first); --gemma the Gemma 3 270M file
#                                                 # (scripts/gemma3_270m.py fetch) as .whl/g1 ..; --fixtures tests/fixtures'
#                                                 # models as .whl/f1 .., which install puts where tests look for
#                                                 # ../shared's (for a tree that leaves tests/fixtures behind:
#                                                 # docs/maintaining.md, "The GPU machine"); --mlx-lm mlx-lm's
#                                                 # wheel (benchmarks/versus_mlx_lm.py's) as .whl/m1, carried beside p1
#   bash benchmarks/gpu.sh stash .whl/pN          # there, one call a part: keep it in $GPU_WORK; the last part
#                                                 # of llama.cpp's source also starts building it in the background
#   bash benchmarks/gpu.sh install .whl/pLAST     # there, the last part: unpack MLX and gguf, write the
#                                                 # TinyLlama-shape Q4_K_M file (mlxllama bench --synthetic's)
#   bash benchmarks/gpu.sh test [PYTEST ARGS]     # there: the whole suite on the GPU (tests/cuda runs only there)
#   bash benchmarks/gpu.sh bench                  # there: bench with the kernels, the plain step and --dequantize,
#                                                 # profiles, the kernel trace, then llama-bench and llama-batched-bench
#   bash benchmarks/gpu.sh structured             # there: tg128 with and without a JSON Schema (bench --json-schema),
#                                                 # with the kernels and on the plain step
#   bash benchmarks/gpu.sh speculative [MODEL]    # there: tg128 with and without prompt lookup (bench --lookup), on
#                                                 # MODEL (default the TinyLlama-shape file; "gemma" for Gemma 3 270M),
#                                                 # then one copy request at a time through mlxllama serve and llama-server,
#                                                 # each without and with prompt lookup (benchmarks/speculative_serve.py),
#                                                 # and ours with the reply as its prediction (every draft right);
#                                                 # "speculative gemma served": the servers only
#   bash benchmarks/gpu.sh models                 # there: MoE prefill by expert order (benchmarks/moe_prefill.py), then
#                                                 # pp512/tg128 at depth 0 and 4096 of the Qwen3-0.6B-shape file and of Gemma 3
#                                                 # 270M (when stashed), each beside llama-bench
#   bash benchmarks/gpu.sh kv [ours|llama]        # there: pp512 and tg128 (1 and 16 sequences) at depth 0, 4096 and
#                                                 # 8192 with the cache unquantized, --kv-bits 8, 4 and 4 with 8-bit
#                                                 # keys (KV_SECONDS a run; KV_RUNS="none 4 4c plain4" adds keys by
#                                                 # channel and 4 bits on the plain step), then llama-bench -d with -ctk/-ctv f16,
#                                                 # q8_0 and q4_0, on a 16k-context copy (no argument: both)
#   bash benchmarks/gpu.sh depth [kernels|timeline|stamps|llama] # there: the kernels' tg128 at depth 0, 4096 and
#                                                 # 8192, one sequence and 16, under other attention settings
#                                                 # (benchmarks/attention_depth.py); the layer timeline at those
#                                                 # depths; the attention items' phases (attention_stamps.py),
#                                                 # unquantized and 8-bit; llama-bench -d and llama-batched-bench
#                                                 # at depth 8192, on a 16k-context copy (no argument: all four)
#   bash benchmarks/gpu.sh serve [CLIENTS [ROUNDS]] # there: mlxllama serve and llama-server (-np = clients) in turn
#                                                 # at each of CLIENTS (default 1,8,16,32), benchmarks/serve_bench.py;
#                                                 # ROUNDS (default 1) times over, alternating, each run labelled with its round;
#                                                 # SERVE_ENGINES="thread process": ours with each --engine in turn
#                                                 # (default: process, as serve runs on a GPU); logs in $OUT/serve-logs
#   bash benchmarks/gpu.sh engine [CLIENTS [ARGS]] # there: what a served first token waits for, every engine call timed
#                                                 # under CLIENTS streaming clients (default 16; benchmarks/engine_turns.py
#                                                 # ARGS, e.g. --eval-joins, --split-step)
#   bash benchmarks/gpu.sh first-use              # there: what a fresh process pays for each new kind of prefill and
#                                                 # step, and a lone client's requests (benchmarks/first_use.py), twice:
#                                                 # the second run in a new process sees what this machine cached
#   bash benchmarks/gpu.sh multi check            # there, on a machine of 4 GPUs: allreduce_cost.py, split_parity.py on
#                                                 # the TinyLlama-shape file (2 and 4 GPUs, tensor and pipeline), then
#                                                 # tests/distributed's commands over NCCL (MULTI_SECONDS: a phase's
#                                                 # time); starts writing the Llama-3-8B-shape file in the background
#   bash benchmarks/gpu.sh multi bench [tiny|8b [ours|llama]]  # there: bench -p 512 -n 128 -b 1,16 in one process (kernels, plain
#                                                 # step) and split over 2 and 4 GPUs by tensor and as a pipeline,
#                                                 # split_parity.py, then llama-bench and llama-batched-bench with
#                                                 # -sm layer and row on the same GPUs; each phase's files come back
#                                                 # as $OUT/multi-PHASE.tgz (benchmarks/multi_gpu_table.py reads them)
#   bash benchmarks/gpu.sh versus [ARGS]          # there: the plain step against mlx-lm's loop (benchmarks/versus_mlx_lm.py
#                                                 # ARGS) on a 16k-context TinyLlama-shape file, then the CUDA launches
#                                                 # of our plain step and of mlx-lm's (kernel_trace.py), and of pp512
#                                                 # (ours as CUDA prefills, ours fused, mlx-lm's), and where
#                                                 # each one's host time goes inside MLX at depth 0 and 4096
#                                                 # (native_profile.py, py-spy's native stacks)
#
# The calls must follow each other while the machine is warm (it is given back 30 s after a call).
# Every command there runs with PYTHONPATH=$GPU_WORK/site; results are written under $OUT when set.
set -uo pipefail
cd "$(dirname "$0")/.."
work=${GPU_WORK:-/tmp/mlxllama-gpu}
out=${OUT:-$work/out}
model=$work/tinyllama-1.1b-Q4_K_M.gguf
gemma=$work/gemma-3-270m-Q4_K_M.gguf
export PYTHONUNBUFFERED=1 PYTHONPATH=$work/site:$PWD
# pyproject.toml installs templates/ as mlxllama.templates; a checkout on PYTHONPATH needs the link
[ -e mlxllama/templates ] || ln -s ../templates mlxllama/templates
log() { echo "=== $* ($(date +%T), ${SECONDS}s)"; }

payload() {
    set -e
    local tmp part tree
    # Each call carries the working tree and one part within 64 MiB: the parts take what the tree leaves.
    tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 cat 2>/dev/null | wc -c)
    part=$((64 * 1024 * 1024 - tree - 1000000))
    if [ "$part" -le 0 ]; then
        echo "gpu.sh payload: the tree that travels is $tree bytes, leaving no room in a call's 64 MiB;" \
            "leave tests/fixtures out of the index first (docs/maintaining.md, 'The GPU')" >&2
        exit 2
    fi
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_5_x86_64 \
        --platform any -d "$tmp/dl" \
        mlx==0.32.4 mlx-cuda-13==0.32.4 gguf==0.19.0 starlette==1.10.0 uvicorn==0.54.0 llguidance==1.9.1 \
        jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 \
        pytest-xdist==3.8.0 execnet==2.1.2 py-spy==0.4.3
    mkdir -p "$tmp/site"
    for wheel in "$tmp"/dl/*.whl; do unzip -q -o "$wheel" -d "$tmp/site"; done
    (cd "$tmp/site" && tar cf - . | xz -9 -T0 > "$tmp/site.tar.xz")
    rm -rf .whl/p[0-9]*
    split -b $part -d -a 2 "$tmp/site.tar.xz" "$tmp/site.part"
    local i=1
    for f in "$tmp"/site.part*; do mkdir -p ".whl/p$i"; mv "$f" ".whl/p$i/"; i=$((i + 1)); done
    if [ "${1:-}" = --llama-cpp ]; then
        python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp/src" llama-cpp-python==0.3.36
        tar xzf "$tmp"/src/llama_cpp_python-0.3.36.tar.gz -C "$tmp/src"
        local full=$tmp/src/llama_cpp_python-0.3.36/vendor/llama.cpp cut=$tmp/llama.cpp
        mkdir -p "$cut/tools" "$cut/ggml/src"
        cp -r "$full"/{CMakeLists.txt,LICENSE,cmake,include,src,common,licenses,vendor} "$cut/"
        cp -r "$full"/tools/{llama-bench,batched-bench,server,mtmd} "$cut/tools/"
        # llama-server without its web page: the UI's CMake files, not its sources
        mkdir -p "$cut/tools/ui" "$cut/scripts"
        cp "$full"/tools/ui/{CMakeLists.txt,ui.cpp.in,ui.h.in} "$cut/tools/ui/"
        cp "$full"/scripts/ui-assets.cmake "$cut/scripts/"
        rm -rf "$cut"/tools/server/{tests,bench}
        printf '%s\n' 'find_package(Threads REQUIRED)' 'llama_add_compile_flags()' 'add_subdirectory(llama-bench)' \
            'add_subdirectory(batched-bench)' 'add_subdirectory(mtmd)' 'add_subdirectory(ui)' 'add_subdirectory(server)' \
            > "$cut/tools/CMakeLists.txt"
        cp -r "$full"/ggml/{CMakeLists.txt,cmake,include} "$cut/ggml/"
        cp -r "$full"/ggml/src/{CMakeLists.txt,*.c,*.cpp,*.h,*.in,ggml-cpu,ggml-cuda,ggml-blas} "$cut/ggml/src/"
        # parts of their own (.whl/l1 ..), stashed first so that the build starts early: the stash of
        # the last starts it
        rm -rf .whl/l[0-9]*
        tar cf - -C "$tmp" llama.cpp | xz -6 -T0 > "$tmp/llama.cpp.tar.xz"
        split -b $part -d -a 2 "$tmp/llama.cpp.tar.xz" "$tmp/llama.part"
        local n=0 total
        total=$(ls "$tmp"/llama.part* | wc -l)
        for f in "$tmp"/llama.part*; do
            n=$((n + 1)); mkdir -p ".whl/l$n"; mv "$f" ".whl/l$n/"; echo "$total" > ".whl/l$n/llama.parts"
        done
    fi
    local option name source
    for option in "$@"; do
        case $option in
            --gemma) name=gemma source=${MLXLLAMA_GEMMA3_270M:-$HOME/.cache/mlxllama/gemma-3-270m-Q4_K_M.gguf}
                     cp "$source" "$tmp/gemma.bin" ;;
            --fixtures) name=fixtures; tar cf "$tmp/fixtures.bin" -C tests/fixtures $(cd tests/fixtures && ls *.gguf) ;;
            --mlx-lm) rm -rf .whl/m1; mkdir -p .whl/m1
                      python3 -m pip download -q --no-deps -d .whl/m1 mlx-lm==0.32.2; continue ;;
            *) continue ;;
        esac
        rm -rf ".whl/${name:0:1}"[0-9]*
        split -b $part -d -a 2 "$tmp/$name.bin" "$tmp/$name.part"
        local i=1
        for f in "$tmp/$name".part*; do mkdir -p ".whl/${name:0:1}$i"; mv "$f" ".whl/${name:0:1}$i/"; i=$((i + 1)); done
    done
    rm -rf "$tmp"
    du -sh .whl/*
}

stash() {
    mkdir -p "$work/site"
    # MLX's CUDA kernels compiled on an earlier machine (gpu.sh multi brings them back as $OUT/mlx-ptx.tgz):
    # MLX reads them from /tmp/mlx instead of compiling for minutes on a fresh machine.
    [ -f "$1/mlx-ptx.tgz" ] && tar xzf "$1/mlx-ptx.tgz" -C /tmp
    cp "$1"/*.part* "$1"/llama.parts "$work/" 2> /dev/null
    for wheel in "$1"/*.whl; do [ -f "$wheel" ] && python3 -m zipfile -e "$wheel" "$work/site"; done
    if [ -f "$1/llama.parts" ] && [ "$(ls "$work"/llama.part?? | wc -l)" = "$(cat "$work/llama.parts")" ]; then
        cat "$work"/llama.part?? | tar xJ -C "$work"
        setsid nohup bash benchmarks/build_llama_cpp.sh "$work/llama.cpp" "$work/llama-build" \
            > "$work/build.log" 2>&1 < /dev/null &
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    ls "$work"
}

install() {
    stash "$1" > /dev/null
    mkdir -p "$work/site"
    cat "$work"/site.part* | xz -d | tar x -C "$work/site" || exit 1
    python3 -c 'import mlx.core as mx; print("MLX", mx.__version__, mx.default_device(), mx.device_info())' || exit 1
    [ -f "$model" ] || python3 -c "from mlxllama import synthetic; synthetic.write('$model')"
    if ls "$work"/gemma.part* > /dev/null 2>&1; then cat "$work"/gemma.part* > "$gemma" && rm "$work"/gemma.part*; fi
    if ls "$work"/fixtures.part* > /dev/null 2>&1; then  # where tests/conftest.py looks for ../shared's models
        mkdir -p ../shared/fixtures/models && cat "$work"/fixtures.part* | tar x -C ../shared/fixtures/models
        ls ../shared/fixtures/models | wc -l
    fi
    ls -la "$gemma" 2> /dev/null
}

run_tests() {
    # tests/fixtures is left out of what travels (docs/maintaining.md); install put its models in
    # ../shared, and links made in another call are gone by this one: link them here.
    if ! ls tests/fixtures/*.gguf > /dev/null 2>&1 && ls ../shared/fixtures/models/*.gguf > /dev/null 2>&1; then
        mkdir -p tests/fixtures
        for f in ../shared/fixtures/models/*.gguf; do ln -sf "$(realpath "$f")" tests/fixtures/; done
    fi
    log the suite on the GPU
    # Into a file under $OUT first: a run cut off by the call's time limit still brings back what it printed.
    mkdir -p "$out"
    python3 -m pytest -q -p no:cacheprovider -rfE "$@" > "$out/pytest.log" 2>&1
    grep -v "^E  \|^    \|^$" "$out/pytest.log" | tail -40
}

llama_cpp_built() {  # wait for the background build; where it finished, its cuBLAS on the library path
    while [ ! -f "$work/llama-build.done" ] && pgrep -f build_llama_cpp > /dev/null; do sleep 5; done
    [ -f "$work/llama-build.done" ] || return 1
    export LD_LIBRARY_PATH=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
}

bench() {
    mkdir -p "$out"
    # native: decoding (1, 8 and 16 sequences) goes through mlxllama.cuda's kernels; plain: the same
    # model through the plain MLX step; dequantize: every weight float16.
    for mode in native plain dequantize; do
        log mlxllama bench $mode
        local flag kernels
        flag=$([ $mode = dequantize ] && echo --dequantize)
        kernels=$([ $mode = plain ] && echo 0 || echo 1)
        MLXLLAMA_CUDA_KERNELS=$kernels timeout 200 python3 cli.py bench -m "$model" -p 512 -n 128 -b 1,8,16 -r 5 \
            $flag --json > "$out/mlxllama-$mode.json"
        python3 -c "import json; r = json.load(open('$out/mlxllama-$mode.json')); print('$mode', round(r['load_seconds'], 2), 's',
            round(r['weight_ratio'], 3), [(t['name'], t['batch'], round(t['tokens_per_second'], 1)) for t in r['tests']])"
        MLXLLAMA_CUDA_KERNELS=$kernels timeout 60 python3 benchmarks/profile_decode.py "$model" $flag --context 512 \
            --json "$out/profile-$mode.json"
    done
    log kernel trace
    timeout 120 python3 benchmarks/kernel_trace.py "$model" --json "$out/kernel-trace.json" | head -7
    log waiting for the llama.cpp build
    if llama_cpp_built; then
        local bin=$work/llama-build/bin
        log llama-bench
        timeout 120 "$bin/llama-bench" -m "$model" -p 512 -n 128 -r 5 -ngl 99 -fa off,on -o json > "$out/llama-bench.json"
        log llama-batched-bench
        timeout 60 "$bin/llama-batched-bench" -m "$model" -c 4096 -b 2048 -ub 512 -npp 1 -ntg 128 -npl 1,8,16 -ngl 99 \
            -fa on 2>&1 | grep "^|" | tee "$out/llama-batched-bench.md"
    fi
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
}

wait_healthy() {  # url pid: until GET url/health is 200, or the server has died
    for _ in $(seq 600); do
        curl -sf "$1/health" > /dev/null && return 0
        kill -0 "$2" 2> /dev/null || return 1
        sleep 0.5
    done
    return 1
}

serve_bench() {  # each round and concurrency: our server, then llama-server, the same client and settings
    mkdir -p "$out/serve-logs"  # the logs in a folder: a call brings back at most 8 files
    local clients round engine url=http://127.0.0.1:8090 bin=$work/llama-build/bin
    # SERVE_ENGINES: serve's --engine values to run in turn each round (default the process alone, as
    # serve runs on a GPU, labelled "mlxllama"; several are labelled "mlxllama-ENGINE")
    local engines=${SERVE_ENGINES:-process}
    label() { [ "$engines" = "$1" ] && echo mlxllama || echo "mlxllama-$1"; }
    measure() {  # LABEL COMMAND...: start a server, run the client against it, stop it
        local label=$1 pid
        shift
        "$@" > "$out/serve-logs/$label-$clients.log" 2>&1 &
        pid=$!
        wait_healthy $url $pid && timeout 300 python3 benchmarks/serve_bench.py --url $url --clients "$clients" \
            --requests 4 --max-tokens 128 --warmup --label "$label-$round" --json "$out/serve-$label-$clients-$round.json"
        kill $pid; wait $pid
    }
    # The build takes every core: wait for it, so that neither server is measured beside it.
    llama_cpp_built
    for round in $(seq "${2:-1}"); do
      for clients in ${1//,/ }; do
        for engine in $engines; do
            log mlxllama serve --engine $engine, $clients clients, round $round
            measure "$(label $engine)" python3 -m mlxllama serve -m "$model" --port 8090 --max-batch "$clients" \
                --engine $engine
        done
        [ -x "$bin/llama-server" ] || continue
        log llama-server -np $clients, round $round
        measure llama-server "$bin/llama-server" -m "$model" --port 8090 -np "$clients" -c $((clients * 512)) -ngl 99 \
            -fa on --jinja
      done
    done
    python3 -c "import glob, json, os; runs = [json.load(open(f)) for f in sorted(glob.glob('$out/serve-*.json'))]
json.dump(runs, open('$out/serve.json', 'w'), indent=1); [os.remove(f) for f in glob.glob('$out/serve-*.json')]"
    python3 benchmarks/serve_bench.py --compare "$out/serve.json"  # each server's rounds pooled
}

engine_turns() {  # each engine call under a burst of streaming clients, and each request's wait (#20's TTFT)
    mkdir -p "$out"
    local clients list=${1:-16}
    shift
    for clients in ${list//,/ }; do
        log "engine turns, $clients clients"
        # 560 s: on a fresh machine the engine's warm-up alone compiles for 5-6 minutes
        timeout 560 python3 benchmarks/engine_turns.py -m "$model" --clients "$clients" --max-batch 16 \
            --json "$out/engine-turns-$clients.json" "$@"
    done
}

first_use() {  # what each new shape costs the first time, in a fresh process (#20's lone-client TTFT)
    mkdir -p "$out"
    local run
    for run in 1 2; do
        log "first use, run $run"
        timeout 280 python3 benchmarks/first_use.py -m "$model" --json "$out/first-use-$run.json"
    done
}

structured() {  # the price of a constraint's masks, side by side with the same loop without one
    mkdir -p "$out"
    for kernels in 1 0; do
        log "mlxllama bench --json-schema, MLXLLAMA_CUDA_KERNELS=$kernels"
        for round in 1 2; do
            MLXLLAMA_CUDA_KERNELS=$kernels timeout 200 python3 -m mlxllama bench -m "$model" -p 0 -n 128 -r 5 \
                --json-schema benchmarks/long-array.schema.json --json > "$out/structured-$kernels-$round.json"
            python3 -c "import json; r = json.load(open('$out/structured-$kernels-$round.json'))
print(r['mode'], [(t['name'], round(t['tokens_per_second'], 1), round(t['stdev'], 1)) for t in r['tests']])"
        done
    done
}

speculative() {  # prompt lookup: tg with and without it (kernels and plain step), then served beside llama-server's
    mkdir -p "$out"
    local text="The committee met on Tuesday to review the budget for the new library. " file=$model tag=""
    if [ "${1:-}" = gemma ]; then file=$gemma tag=-gemma; fi
    for kernels in $([ "${2:-}" = served ] || echo 1 0); do
        log "mlxllama bench --lookup 3 on $(basename "$file"), MLXLLAMA_CUDA_KERNELS=$kernels"
        MLXLLAMA_CUDA_KERNELS=$kernels timeout 200 python3 -m mlxllama bench -m "$file" -p 0 -n 128 -r 5 \
            --lookup 3 --draft-tokens 5 --draft-prompt "$text$text$text$text" --json > "$out/speculative$tag-$kernels.json"
        python3 -c "import json; r = json.load(open('$out/speculative$tag-$kernels.json'))
print(r['mode'], [(t['name'], round(t['tokens_per_second'], 1), round(t['stdev'], 1)) for t in r['tests']], r['speculation'][:1])"
    done
    # One request at a time through each server, the same raw copy prompt, greedy, 128 tokens:
    # mlxllama serve without and with per-request lookup (its kernels decode the plain rows), then
    # llama-server without and with its prompt lookup (--spec-type ngram-simple, 3-grams, 5 drafts).
    printf '%s' "$text$text$text$text" > "$work/copy.txt"
    local port=8093 spec="benchmarks/speculative_serve.py --url http://127.0.0.1:8093 --prompt-file $work/copy.txt -r 5"
    log "mlxllama serve $(basename "$file")"
    # (a template only because serve needs one: /v1/completions feeds the raw prompt)
    python3 -m mlxllama serve -m "$file" --port $port --no-webui --template chatml > "$work/serve.log" 2>&1 &
    local pid=$!
    until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 1; kill -0 $pid || { cat "$work/serve.log"; return; }; done
    timeout 120 python3 $spec --label "mlxllama serve" --json "$out/serve-plain$tag.json"
    timeout 120 python3 $spec --label "mlxllama serve, lookup 3, K 5" --extra '{"lookup": 3, "draft_tokens": 5}' \
        --json "$out/serve-lookup$tag.json"
    # Predicted Outputs with the reply itself as the prediction (an edit that changes nothing): every
    # draft right, what a check of K + 1 positions buys at best.
    local predicted
    predicted=$(python3 -c "import json; text = json.load(open('$out/serve-plain$tag.json'))['runs'][0]['text']
print(json.dumps({'prediction': {'type': 'content', 'content': text}, 'draft_tokens': 7}))")
    timeout 120 python3 $spec --label "mlxllama serve, prediction, K 7" --extra "$predicted" --json "$out/serve-prediction$tag.json"
    kill $pid; wait $pid 2> /dev/null
    llama_cpp_built || return
    local name flags
    for name in plain ngram; do
        flags=$([ $name = ngram ] && echo "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 5")
        log "llama-server $name"
        "$work/llama-build/bin/llama-server" -m "$file" --port $port -ngl 99 -fa on -np 1 $flags > "$work/llama-server.log" 2>&1 &
        pid=$!
        until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 1; kill -0 $pid || { tail "$work/llama-server.log"; return; }; done
        timeout 120 python3 $spec --label "llama-server $name" --json "$out/llama-server-$name$tag.json"
        kill $pid; wait $pid 2> /dev/null
    done
}

models() {  # MoE prefill in expert order; the 2026 models' shapes beside llama-bench (#19)
    mkdir -p "$out"
    log MoE prefill, token order and expert order
    timeout 240 python3 benchmarks/moe_prefill.py --tokens 1,8,16,32,64,128,512 --json "$out/moe-prefill.json"
    local qwen=$work/qwen3-0.6b-Q4_K_M.gguf file name
    [ -f "$qwen" ] || python3 -c "from mlxllama import synthetic; synthetic.write('$qwen', 'qwen3-0.6b')"
    for file in "$qwen" "$gemma"; do
        [ -f "$file" ] || continue
        name=$(basename "$file" .gguf)
        log "mlxllama bench $name"
        timeout 300 python3 -m mlxllama bench -m "$file" -p 512 -n 128 -r 3 -d 0,4096 --json > "$out/$name-mlxllama.json"
        python3 -c "import json; r = json.load(open('$out/$name-mlxllama.json')); print(r['mode'], round(r['weight_ratio'], 3),
            [(t['name'], t.get('depth', 0), round(t['tokens_per_second'], 1)) for t in r['tests']])"
    done
    llama_cpp_built || return
    for file in "$qwen" "$gemma"; do
        [ -f "$file" ] || continue
        name=$(basename "$file" .gguf)
        log "llama-bench $name"
        timeout 200 "$work/llama-build/bin/llama-bench" -m "$file" -p 512 -n 128 -r 3 -d 0,4096 -ngl 99 -fa on \
            -o json > "$out/$name-llama-bench.json"
        python3 -c "import json; print([(r['n_prompt'], r['n_gen'], r['n_depth'], round(r['avg_ts'], 1))
    for r in json.load(open('$out/$name-llama-bench.json'))])"
    done
}

kv_depth() {  # the quantized KV cache at depth through the kernels, side by side with llama.cpp's quantized cache
    mkdir -p "$out"
    local deep=$work/tinyllama-1.1b-16k-Q4_K_M.gguf part=${1:-all} run flags
    case $part in all|ours|llama) ;; *) echo "gpu.sh kv: unknown part '$part' (ours, llama)" >&2; exit 2 ;; esac
    [ -f "$deep" ] || python3 -c "from mlxllama import synthetic; synthetic.write('$deep', context=16384)"
    # By default unquantized and 8-bit twice, interleaved (8-bit's target is a ratio to unquantized),
    # 4-bit and 8-bit keys with 4-bit values once (KV_RUNS: others); KV_SECONDS bounds each run.
    # 4c: keys by channel, one sequence (what docs/benchmarks.md quotes); plain4: 4 bits on the plain step
    # (MLXLLAMA_CUDA_KERNELS=0), the step keys by channel take.
    local batches env
    for run in $([ "$part" = llama ] || echo ${KV_RUNS:-none 8 4 k8v4 none 8}); do
        batches=1,16 env=
        case $run in
            none) flags= ;;
            k8v4) flags="--kv-bits 4 --kv-key-bits 8" ;;
            4c) flags="--kv-bits 4 --kv-keys-by-channel" batches=1 ;;
            plain4) flags="--kv-bits 4" batches=1 env=MLXLLAMA_CUDA_KERNELS=0 ;;
            *) flags="--kv-bits $run" ;;
        esac
        log "$env mlxllama bench -b $batches -d 0,4096,8192 $flags"
        env $env timeout "${KV_SECONDS:-150}" python3 -m mlxllama bench -m "$deep" -p 512 -n 128 -r 2 -b $batches \
            -d 0,4096,8192 $flags --json > "$out/kv-$run.json.tmp" && cat "$out/kv-$run.json.tmp" >> "$out/kv-$run.jsonl"
        rm -f "$out/kv-$run.json.tmp"
        python3 -c "import json
for line in open('$out/kv-$run.jsonl'): r = json.loads(line)
print(r['mode'], r['kv_cache'], r['kv_bytes_per_position'], [(t['name'], round(t['tokens_per_second'], 1)) for t in r['tests']])"
    done
    if [ "$part" != ours ] && llama_cpp_built; then
        for run in f16 q8_0 q4_0; do
            log "llama-bench -d 0,4096,8192 -ctk $run -ctv $run"
            timeout 150 "$work/llama-build/bin/llama-bench" -m "$deep" -p 512 -n 128 -r 2 -ngl 99 -fa on \
                -d 0,4096,8192 -ctk $run -ctv $run -o json > "$out/llama-bench-kv-$run.json"
            python3 -c "import json; print([(r['n_prompt'], r['n_gen'], r['n_depth'], round(r['avg_ts'], 1))
    for r in json.load(open('$out/llama-bench-kv-$run.json'))])"
        done
    fi
}

attention_depth() {  # the kernels' attention at depth (#24), beside llama.cpp's
    mkdir -p "$out"
    local deep=$work/tinyllama-1.1b-16k-Q4_K_M.gguf part=${1:-all}
    case $part in all|kernels|timeline|stamps|llama) ;; *) echo "gpu.sh depth: unknown part '$part' (kernels, timeline, stamps, llama)" >&2; exit 2 ;; esac
    wants() { [ "$part" = all ] || [ "$part" = "$1" ]; }
    [ -f "$deep" ] || python3 -c "from mlxllama import synthetic; synthetic.write('$deep', context=16384)"
    if wants kernels; then
        log attention_depth.py
        timeout 420 python3 benchmarks/attention_depth.py "$deep" --json "$out/attention-depth.jsonl"
    fi
    if wants timeline; then
        log layer timeline
        timeout 120 python3 benchmarks/layer_timeline.py "$deep" --positions 100,4096,8191 | tee "$out/layer-timeline.txt"
    fi
    if wants stamps; then
        local flags
        for flags in "" "--kv-bits 8"; do
            log "attention_stamps.py $flags"
            timeout 120 python3 benchmarks/attention_stamps.py "$deep" --positions 100,1024,8191 $flags \
                | tee -a "$out/attention-stamps.txt"
        done
    fi
    if wants llama && llama_cpp_built; then
        local bin=$work/llama-build/bin
        log "llama-bench -d 0,4096,8192"
        timeout 150 "$bin/llama-bench" -m "$deep" -p 0 -n 128 -r 2 -d 0,4096,8192 -ngl 99 -fa on -o json \
            > "$out/llama-bench-depth.json"
        python3 -c "import json; print([(r['n_gen'], r['n_depth'], round(r['avg_ts'], 1))
    for r in json.load(open('$out/llama-bench-depth.json'))])"
        log "llama-batched-bench, 16 sequences at depth 8192"
        timeout 150 "$bin/llama-batched-bench" -m "$deep" -c $((16 * (8192 + 128))) -b 2048 -ub 512 -npp 8192 \
            -ntg 128 -npl 16 -ngl 99 -fa on 2>&1 | grep "^|" | tee "$out/llama-batched-bench-depth.md"
    fi
}

versus() {  # the plain MLX step against mlx-lm's loop (#22), in one process; then its launches in a CUDA trace
    mkdir -p "$out"
    local deep=$work/tinyllama-1.1b-16k-Q4_K_M.gguf
    [ -f "$deep" ] || python3 -c "from mlxllama import synthetic; synthetic.write('$deep', context=16384)"
    log "benchmarks/versus_mlx_lm.py $*"
    MLXLLAMA_CUDA_KERNELS=0 timeout 500 python3 benchmarks/versus_mlx_lm.py "$deep" --json "$out/versus-mlx-lm.json" "$@"
    local step
    for step in model-step mlx-lm; do
        log "kernel trace: $step"
        MLXLLAMA_CUDA_KERNELS=0 timeout 90 python3 benchmarks/kernel_trace.py "$deep" $([ $step = model-step ] || echo --$step) \
            --json "$out/kernel-trace-$step.json" | sed -n 6,10p
    done
    # pp512's kernels: ours as the runtime prefills on CUDA (explicit attention), ours with the fused
    # kernel (as a Mac prefills), mlx-lm's
    for step in runtime fused-prefill mlx-lm; do
        log "kernel trace: prefill 512, $step"
        MLXLLAMA_CUDA_KERNELS=0 timeout 90 python3 benchmarks/kernel_trace.py "$deep" --prefill 512 --steps 5 \
            $([ $step = runtime ] || echo --$step) --json "$out/kernel-trace-pp512-$step.json" | sed -n 6,10p
    done
    # py-spy's binary, unpacked from its wheel with the rest (payload): where native_profile.py finds it
    PATH=$(dirname "$(ls "$work"/site/py_spy-*.data/scripts/py-spy)"):$PATH
    local engine depth
    for depth in 0 4096; do
        for engine in ours mlx-lm; do
            log "native profile: $engine at depth $depth"
            MLXLLAMA_CUDA_KERNELS=0 timeout 60 python3 benchmarks/native_profile.py "$deep" --depth $depth --seconds 8 \
                $([ $engine = ours ] || echo --mlx-lm) --json "$out/native-$engine-$depth.json" | sed -n 1,12p
        done
    done
}

# Several GPUs (#27): mlx.launch over NCCL, one GPU a rank. NVLink multicast stays off (the
# machines' rule: it can take a shared host's GPUs out of service).
export NCCL_NVLS_ENABLE=0
big=$work/llama-3-8b-Q4_K_M.gguf
multi_out=$work/multi
budget=${MULTI_SECONDS:-540}  # a phase's steps stop starting after this many seconds (a call has 600)

left() { echo $((budget - SECONDS)); }

launcher() {  # mlx.launch and mlxllama as a user has them on PATH (the packages are unpacked, not installed)
    mkdir -p "$work/bin" "$multi_out"
    printf '#!/bin/sh\nexec python3 -c "import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = \\"mlx.launch\\"; main()" "$@"\n' \
        > "$work/bin/mlx.launch"
    printf '#!/bin/sh\nexec python3 -m mlxllama "$@"\n' > "$work/bin/mlxllama"
    chmod +x "$work/bin/mlx.launch" "$work/bin/mlxllama"
    export PATH=$work/bin:$PATH
    nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
}

ranks() {  # N COMMAND...: the command under mlx.launch over NCCL on GPUs 0..N-1 (alone for N = 1)
    local n=$1 limit
    shift
    limit=$(left)
    [ "$limit" -gt 20 ] || { echo "skipped (out of time): $*" >&2; return; }
    [ "$limit" -lt 240 ] || limit=240
    if [ "$n" = 1 ]; then timeout -k 10 $limit "$@"; else
        timeout -k 10 $limit mlx.launch -n "$n" --backend nccl --nccl-port $((20000 + RANDOM % 20000)) -- "$@"
    fi
    pkill -f "[p]ython3 -m mlxllama"; pkill -f "[s]plit_parity.py"; pkill -f "[a]llreduce_cost.py"; true
}

multi_check() {
    launcher
    if [ ! -f "$big" ] && ! pgrep -f "[l]lama-3-8b" > /dev/null; then  # for `multi bench 8b`, in a later call
        setsid nohup python3 -c "from mlxllama import synthetic; synthetic.write('$big.part', 'llama-3-8b')
import os; os.rename('$big.part', '$big')" > "$work/write-8b.log" 2>&1 < /dev/null &
    fi
    local o=$multi_out n
    for n in 2 4; do
        log "allreduce_cost.py, $n GPUs"
        ranks $n python3 benchmarks/allreduce_cost.py --json "$o/allreduce-$n.json"
    done
    multi_parity "$model" tiny "2-tensor 2-pipeline 4-tensor 4-pipeline"
    # The commands as a user runs them under mlx.launch (chat-tiny: generate, chat, batch, serve), 2 GPUs.
    log "tests/distributed over NCCL, 2 GPUs ($(left) s left)"
    [ "$(left)" -gt 60 ] && MLXLLAMA_LAUNCH_BACKEND=nccl timeout -k 10 $(left) python3 -m pytest -q -p no:cacheprovider -rfE \
        tests/distributed -k "generate_and_chat or batch_split or serve or errors" > "$o/pytest-distributed-nccl.log" 2>&1
    [ -f "$o/pytest-distributed-nccl.log" ] && grep -v "^E  \|^    \|^$" "$o/pytest-distributed-nccl.log" | tail -25
    multi_pack check
}

multi_parity() {  # FILE TAG "N-SPLIT ...": split_parity.py, one process against each split
    local o=$multi_out config
    log "split_parity.py $2"
    ranks 1 python3 benchmarks/split_parity.py "$1" --save "$o/parity-$2-ref.npz" -n 32
    for config in $3; do
        ranks ${config%-*} python3 benchmarks/split_parity.py "$1" --against "$o/parity-$2-ref.npz" \
            $([ ${config#*-} = pipeline ] && echo --pipeline) --json "$o/parity-$2-$config.json"
    done
    rm -f "$o/parity-$2-ref.npz"
}

multi_bench() {  # tiny|8b [ours|llama|both]: the speed table's rows, ours then llama.cpp's, on the same GPUs
    launcher
    local o=$multi_out tag=${1:-tiny} which=${2:-both} file=$model n split bin=$work/llama-build/bin
    if [ "$tag" = 8b ]; then
        file=$big
        while [ ! -f "$big" ] && pgrep -f "[l]lama-3-8b" > /dev/null; do sleep 2; done
        [ -f "$big" ] || { cat "$work/write-8b.log"; return; }
    fi
    if [ "$which" != llama ]; then
        local bench="mlxllama bench -m $file -p 512 -n 128 -b 1,16 -r 3 --json"
        log "bench $tag, one process: kernels, then the plain step"
        ranks 1 $bench > "$o/bench-$tag-1-kernels.json"
        MLXLLAMA_CUDA_KERNELS=0 ranks 1 $bench > "$o/bench-$tag-1-plain.json"
        for n in 2 4; do
            for split in tensor pipeline; do
                log "bench $tag, $n GPUs, $split"
                ranks $n $bench $([ $split = pipeline ] && echo --pipeline) > "$o/bench-$tag-$n-$split.json"
            done
        done
        python3 -c "import glob, json
for f in sorted(glob.glob('$o/bench-$tag-*.json')):
    try: r = json.load(open(f))
    except ValueError: print(f, 'no result'); continue
    print(f.split('/')[-1], r['parallel'] or '-', [(t['name'], t['batch'], round(t['tokens_per_second'], 1)) for t in r['tests']],
          [round(x['weight_bytes'] / 2**20) for x in r['ranks']] or round(r['weight_bytes'] / 2**20))"
        [ "$tag" = tiny ] || multi_parity "$file" "$tag" "2-tensor 4-tensor"
    fi
    if [ "$which" != ours ] && llama_cpp_built; then
        local gpus sm
        for gpus in 0 0,1 0,1,2,3; do
            n=$(( (${#gpus} + 1) / 2 ))
            sm=$([ $n = 1 ] && echo none || echo layer,row)
            [ "$(left)" -gt 30 ] || break
            # one -sm a run: this llama.cpp refuses -sm row ("device CUDA0 does not support split buffers"),
            # and llama-bench drops a whole run's results at its first failure
            for sm in ${sm//,/ }; do
                log "llama-bench $tag, GPUs $gpus, -sm $sm"
                CUDA_VISIBLE_DEVICES=$gpus timeout 150 "$bin/llama-bench" -m "$file" -p 512 -n 128 -r 3 -ngl 99 -fa on -sm $sm \
                    -o json > "$o/llama-bench-$tag-$n-$sm.json" 2> "$o/llama-bench-$tag-$n-$sm.err" || tail -1 "$o/llama-bench-$tag-$n-$sm.err"
                CUDA_VISIBLE_DEVICES=$gpus timeout 100 "$bin/llama-batched-bench" -m "$file" -c 4096 -b 2048 -ub 512 -npp 1 \
                    -ntg 128 -npl 1,16 -ngl 99 -fa on -sm $sm 2>&1 | grep "^|" > "$o/llama-batched-$tag-$n-$sm.md"
            done
        done
        python3 -c "import glob, json
for f in sorted(glob.glob('$o/llama-bench-$tag-*.json')):
    try: print(f.split('/')[-1], [(r['split_mode'], r['n_prompt'], r['n_gen'], round(r['avg_ts'], 1)) for r in json.load(open(f))])
    except ValueError: print(f, 'no result')"
        tail -n 2 "$o"/llama-batched-$tag-*.md
    fi
    multi_pack "bench-$tag-$which"
}

multi_pack() {  # the phase's files back in one (a call brings back at most 8), and MLX's compiled kernels
    mkdir -p "$out"
    tar czf "$out/multi-$1.tgz" -C "$work" multi && rm -rf "$multi_out"
    [ -d /tmp/mlx ] && tar czf "$out/mlx-ptx.tgz" -C /tmp mlx
}

case ${1:-} in
    payload) shift; payload "$@" ;;
    stash) stash "$2" ;;
    install) install "$2" ;;
    test) shift; run_tests "$@" ;;
    bench) bench ;;
    serve) serve_bench "${2:-1,8,16,32}" "${3:-1}" ;;
    engine) shift; engine_turns "${1:-16}" "${@:2}" ;;
    first-use) first_use ;;
    structured) structured ;;
    speculative) speculative "${2:-}" "${3:-}" ;;
    models) models ;;
    kv) kv_depth "${2:-all}" ;;
    depth) attention_depth "${2:-all}" ;;
    versus) shift; versus "$@" ;;
    multi) case ${2:-} in check) multi_check ;; bench) multi_bench "${3:-tiny}" "${4:-both}" ;; *) sed -n '2,65p' "$0"; exit 2 ;; esac ;;
    *) sed -n '2,65p' "$0"; exit 2 ;;
esac
