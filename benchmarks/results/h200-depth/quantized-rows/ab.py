"""mlxllama bench's tg128, one sequence, over chosen builds in one process, in turn, for ROUNDS rounds:

    python benchmarks/results/h200-depth/quantized-rows/ab.py MODEL SOURCE:QUERY_HEADS:KV_BITS[:RUNS_LIMIT],... ROUNDS DEPTHS

SOURCE is "shipped" or a copy of decode_step.cu, as attention_depth.py --sources takes it (whose
--query-heads, --runs-limits and --kv-bits take every combination; this takes the ones named);
RUNS_LIMIT is kernels.RUNS_LIMIT, the shipped one where left out. One JSON line a build, cache
and depth."""
import json, sys
sys.path.insert(0, "benchmarks")
import attention_depth as ad
from mlxllama import bench
from mlxllama.cache import KVQuantization

model, rounds, depths = sys.argv[1], int(sys.argv[3]), sys.argv[4]
combos = [(c.split(":") + [ad.SHIPPED["runs_limit"]])[:4] for c in sys.argv[2].split(",")]
for r in range(rounds):
    for src, qh, kv, limit in combos:
        ad.use(int(qh), int(limit), 1, src)
        rep = bench.run(model, n_prompt=0, n_gen=128, batches=(1,), repetitions=2,
                        depths=tuple(int(d) for d in depths.split(",")),
                        kv_quantization=KVQuantization(int(kv)) if int(kv) else None)
        assert rep.mode == "native+kernels", rep.mode
        for t in rep.tests:
            print(json.dumps(dict(source=src, qh=int(qh), kv=int(kv), runs_limit=int(limit), round=r, depth=t.depth,
                                  tps=round(t.median, 1), sd=round(t.stdev, 1))), flush=True)
