"""tg128 of one sequence at DEPTH over an unquantized, a 4-bit and an 8-bit cache in one process, in turn, ROUNDS rounds:

    python benchmarks/results/h200-depth/nibbles-in-place/pairs.py MODEL DEPTH ROUNDS

Each cache is filled to DEPTH once and warmed by 32 steps; a round then times 128 greedy steps over
each (bench.time_steps, the host one step behind the device as in generate), the order reversed
every other round, each cache cut back to DEPTH after. One JSON line a round, t/s by cache."""
import json, sys
import mlxllama
from mlxllama import bench
from mlxllama.cache import KVQuantization

model, depth, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
caches = {}
for kv in (0, 4, 8):
    rt = mlxllama.load(model, kv_quantization=KVQuantization(kv) if kv else None)
    cache, token = bench.first_token(rt, 1, depth, 0, None)
    caches[kv] = (rt, cache, token)
    bench.time_steps(lambda t, rt=rt, cache=cache: rt.model.step(t, cache), token, 32)  # warm
    bench.cut_back(cache, depth)
for r in range(rounds):
    row = {"round": r}
    for kv, (rt, cache, token) in (list(caches.items()) if r % 2 == 0 else list(caches.items())[::-1]):
        seconds = bench.time_steps(lambda t, rt=rt, cache=cache: rt.model.step(t, cache), token, 128)
        bench.cut_back(cache, depth)
        row[f"kv{kv}"] = round(128 / seconds, 1)
    print(json.dumps(row), flush=True)
