# The tree against an earlier one, side by side on one GPU machine: weights held and tg128 at 1 and 16
# sequences of each file, in a process of its own each, alternating, ROUNDS (default "1 2") times.
#   here:  git archive REV mlxllama | tar -x -C .whl/s/base   (less mlxllama/data/*.gguf: bench is given -m)
#   there: bash benchmarks/results/h100-q6k-output/ab.sh .whl/s/base/mlxllama   (after gpu.sh's stash and
#          install, OUT set; FILES: the GGUF files, default the Qwen3-0.6B-shape and TinyLlama-shape ones)
export PYTHONPATH=/tmp/mlxllama-gpu/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
W=/tmp/mlxllama-gpu
Q=$W/qwen3-0.6b-Q4_K_M.gguf T=$W/tinyllama-1.1b-Q4_K_M.gguf
[ -f $Q ] || python3 -c "from mlxllama import synthetic; synthetic.write('$Q', 'qwen3-0.6b')"
rm -rf /tmp/v_base && mkdir -p /tmp/v_base && cp -r "$1" /tmp/v_base/mlxllama && ln -s $PWD/templates /tmp/v_base/mlxllama/templates
summary() { python3 -c "import json,sys
r = json.load(open(sys.argv[1])); print(sys.argv[2], r['mode'], 'held', round(r['weight_ratio'], 3), [(t['name'], t.get('batch'), round(t['tokens_per_second'], 1)) for t in r['tests']])" "$@"; }
for round in ${ROUNDS:-1 2}; do
  for v in new base; do
    dir=$PWD; [ $v = base ] && dir=/tmp/v_base
    for f in ${FILES:-$Q $T}; do
      n=$(basename $f .gguf)
      echo "=== $v $n round $round $(date +%T)"
      (cd $dir && PYTHONPATH=/tmp/mlxllama-gpu/site:$dir timeout 200 python3 -m mlxllama bench -m $f -p 512 -n 128 -r 3 -b 1,16 --json > $OUT/$n-$v-$round.json) && summary $OUT/$n-$v-$round.json "$v $n"
    done
  done
done
