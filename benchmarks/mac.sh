#!/usr/bin/env bash
# The table that matters on Apple Silicon, which this project cannot reach: run it on a Mac and paste
# what it prints into an issue (README, "Benchmarks").
#
#   bash benchmarks/mac.sh [OUT_DIR]        (about 10 minutes on an M-series Mac; OUT_DIR default ./mac-report)
#
# It makes a venv with mlxllama (and mlx-lm, for the side by side), then prints one markdown report:
# the parity tests on the repository's fixtures on Metal (logits against llama.cpp's), then the
# plain step against mlx-lm's loop on a TinyLlama-1.1B-shape Q4_K_M file with a 16k context
# (benchmarks/versus_mlx_lm.py: tg128 at depth 0, 4096 and 8192, one and 8 sequences, pp512, five
# interleaved rounds), with each engine's launches a step and weights held; then the K-types' products
# in MLX's affine form against the sub-block form the CPU holds them in (benchmarks/sub_block_products.py),
# which says whether Metal should hold them so too.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-mac-report}
mkdir -p "$out"
if [ "$(uname -s)-$(uname -m)" != Darwin-arm64 ]; then
    echo "benchmarks/mac.sh is for Apple Silicon (this is $(uname -s) $(uname -m))" >&2
    exit 2
fi
venv=$out/venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q -e ".[test,bench]"
python=$venv/bin/python
model=$out/tinyllama-1.1b-16k-Q4_K_M.gguf
[ -f "$model" ] || "$python" -c "from mlxllama import synthetic; synthetic.write('$model', context=16384)"

parity=$("$python" -m pytest -q -p no:cacheprovider tests/parity 2>&1 | tail -1)
versus=$("$python" benchmarks/versus_mlx_lm.py "$model" --batches 1,8 --depths 0,4096,8192 --rounds 5 \
    --json "$out/versus-mlx-lm.json" 2> "$out/versus.log")
products=$("$python" benchmarks/sub_block_products.py --shapes 5632x2048,2048x5632,32000x2048 --rows 1,8 \
    --json "$out/sub-block-products.json" 2> "$out/products.log")
cat <<EOF
### mlxllama on $(sysctl -n machdep.cpu.brand_string), macOS $(sw_vers -productVersion), commit $(git rev-parse --short HEAD)

- Parity tests on the fixtures (Metal): $parity
$versus

K-type products on Metal, affine form against sub-block form (ms a call, bits a weight held, error):

\`\`\`
$products
\`\`\`
EOF
