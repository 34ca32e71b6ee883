# A/B: the grid barrier's poll with a __nanosleep backoff against the shipped one (one H100 machine, one call).
export PYTHONPATH=/tmp/mlxllama-gpu/site:$PWD
D=/tmp/mlxllama-gpu/tinyllama-1.1b-16k-Q4_K_M.gguf
[ -f $D ] || python3 -c "from mlxllama import synthetic; synthetic.write('$D', context=16384)"
VARIANTS=${VARIANTS:-base b100}
for v in $VARIANTS; do
  dir=/tmp/v_$v; rm -rf $dir; mkdir -p $dir
  tar -C $PWD --exclude=./.whl -cf - . | tar -C $dir -xf -
  [ $v = base ] && continue
  python3 - $dir/mlxllama/cuda/decode_step.cu ${v#b} <<'PY'
import sys
path, ns = sys.argv[1], sys.argv[2]
src = open(path).read()
old = '''    do {
      asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(seen) : "l"(arrivals) : "memory");
    } while (seen < target);'''
new = f'''    while (true) {{
      asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(seen) : "l"(arrivals) : "memory");
      if (seen >= target) break;
      __nanosleep({ns});
    }}'''
assert src.count(old) == 1
open(path, "w").write(src.replace(old, new))
PY
done
summary() { python3 -c "import json,sys
for line in open(sys.argv[1]):
    r = json.loads(line); print(sys.argv[2], [(t['name'], t.get('batch'), round(t['tokens_per_second'], 1)) for t in r['tests']])" "$@"; }
for round in 1 2; do
  for v in $VARIANTS; do
    echo "=== bench $v round $round $(date +%T)"
    (cd /tmp/v_$v && PYTHONPATH=/tmp/mlxllama-gpu/site:/tmp/v_$v timeout 200 python3 -m mlxllama bench -m $D -p 0 -n 128 -r 2 -b 1,16 -d 0,8192 --json > $OUT/bench-$v-$round.json) && summary $OUT/bench-$v-$round.json $v
  done
done
for v in $VARIANTS; do
  echo "=== stamps $v $(date +%T)"
  (cd /tmp/v_$v && PYTHONPATH=/tmp/mlxllama-gpu/site:/tmp/v_$v timeout 120 python3 benchmarks/attention_stamps.py $D --positions 100,8191) | tee $OUT/stamps-$v.txt
done
echo "=== done $(date +%T)"
