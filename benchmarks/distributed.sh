#!/usr/bin/env bash
# Tokens/s and per-rank memory of one process against two under mlx.launch (ring backend on
# 127.0.0.1), split by tensor and as a pipeline, for chat-tiny and a TinyLlama-shape synthetic file.
# Usage: bash benchmarks/distributed.sh OUT_DIR [EXTRA BENCH ARGS...]
set -euo pipefail
out=${1:?usage: distributed.sh OUT_DIR}; shift
mkdir -p "$out"
tiny="$out/tinyllama-1.1b-Q4_K_M.gguf"
[ -f "$tiny" ] || mlxllama bench --synthetic tinyllama-1.1b -m "$tiny" -p 0 -n 0 > /dev/null
run() {  # NAME MODEL BENCH-ARGS...
  local name=$1 model=$2; shift 2
  mlxllama bench -m "$model" "$@" --json > "$out/$name-1.json"
  mlx.launch -n 2 --backend ring -- mlxllama bench -m "$model" "$@" --json > "$out/$name-tensor.json"
  mlx.launch -n 2 --backend ring -- mlxllama bench -m "$model" "$@" --pipeline --json > "$out/$name-pipeline.json"
}
run chat-tiny "$(python -c 'import mlxllama.cli_options as o; print(o.default_model_path())')" -p 128 -n 32 -b 1,8 -r 3 "$@"
run tinyllama "$tiny" -p 32 -n 8 -b 1 -r 2 "$@"
rm -f "$tiny"
python - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print("| model | processes | split | test | batch | t/s | weights held a rank (MiB) |")
print("| --- | ---: | --- | --- | ---: | ---: | --- |")
for name in ("chat-tiny", "tinyllama"):
    for split in ("1", "tensor", "pipeline"):
        r = json.loads((out / f"{name}-{split}.json").read_text())
        held = ", ".join(f"{x['weight_bytes'] / 2**20:.1f}" for x in r["ranks"]) or f"{r['weight_bytes'] / 2**20:.1f}"
        for t in r["tests"]:
            print(f"| {name} | {1 if split == '1' else 2} | {'-' if split == '1' else split} | {t['name']} | {t['batch']} "
                  f"| {t['tokens_per_second']:.1f} | {held} |")
PY
