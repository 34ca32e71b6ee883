# Builds of decode_step.cu against HEAD's on one GPU machine: VARIANTS="base NAME ..." bash ab.sh ROUNDS [stamps],
# run from the repository root there with OUT set, after gpu.sh's stash and install. NAME is NAME.patch beside
# this script, applied to a copy of the tree; each build runs in its own processes, in turn, each round.
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH=/tmp/mlxllama-gpu/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
D=/tmp/mlxllama-gpu/tinyllama-1.1b-16k-Q4_K_M.gguf
[ -f $D ] || python3 -c "from mlxllama import synthetic; synthetic.write('$D', context=16384)"
VARIANTS=${VARIANTS:-base plain-loads}
for v in $VARIANTS; do
  dir=/tmp/v_$v; rm -rf $dir; mkdir -p $dir
  tar -C $PWD --exclude=./.whl -cf - . | tar -C $dir -xf -
  [ $v = base ] || (cd $dir && patch -s -p1 < "$here/$v.patch") || exit 1
done
summary() { python3 -c "import json,sys
for line in open(sys.argv[1]):
    r = json.loads(line); print(sys.argv[2], [(t['name'], t.get('batch'), round(t['tokens_per_second'], 1)) for t in r['tests']])" "$@"; }
for round in $1; do
  for v in $VARIANTS; do
    echo "=== bench $v round $round $(date +%T)"
    (cd /tmp/v_$v && PYTHONPATH=/tmp/mlxllama-gpu/site:/tmp/v_$v timeout 240 python3 -m mlxllama bench -m $D -p 0 -n 128 -r 2 -b 1,16 -d 0,8192 --json > $OUT/bench-$v-$round.json) && summary $OUT/bench-$v-$round.json $v
  done
done
if [ "$2" = stamps ]; then
  for v in $VARIANTS; do
    echo "=== stamps $v $(date +%T)"
    (cd /tmp/v_$v && PYTHONPATH=/tmp/mlxllama-gpu/site:/tmp/v_$v timeout 120 python3 benchmarks/attention_stamps.py $D --positions 100,1023,8191) | tee $OUT/stamps-$v.txt
  done
fi
