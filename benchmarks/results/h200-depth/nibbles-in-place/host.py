"""The host's time a decode step, by part, over an unquantized and a 4-bit cache, twice each in turn:

    python benchmarks/results/h200-depth/nibbles-in-place/host.py MODEL DEPTH [profile]

One sequence at DEPTH, three runs of 128 greedy steps, the first left out: `build` is the step's
graph made (KernelStep's Python and its mx.async_eval of the logits), `queue` the argmax handed to
the device, `wait` the host waiting for the step before (token.tolist()), `total` a step. With
`profile`, cProfile of 64 more steps over the 4-bit cache."""
import cProfile, pstats, statistics, sys, time
import mlx.core as mx
import mlxllama
from mlxllama import bench
from mlxllama.cache import KVQuantization

model, depth = sys.argv[1], int(sys.argv[2])
for kv in (0, 4, 0, 4):
    rt = mlxllama.load(model, kv_quantization=KVQuantization(kv) if kv else None)
    cache, token = bench.first_token(rt, 1, depth, 0, None)
    step = lambda t: rt.model.step(t, cache)
    parts = {"build": [], "queue": [], "wait": [], "total": []}
    for rep in range(3):
        for _ in range(128):
            a = time.perf_counter()
            nxt = mx.argmax(step(token), axis=-1)[:, None]
            b = time.perf_counter()
            mx.async_eval(nxt)
            c = time.perf_counter()
            token.tolist()
            d = time.perf_counter()
            token = nxt
            if rep:
                for k, v in zip(parts, (b - a, c - b, d - c, d - a)):
                    parts[k].append(v)
        token.tolist()
        bench.cut_back(cache, depth)
    print(f"kv {kv}: " + "  ".join(f"{k} {statistics.median(v) * 1e6:.0f} us (mean {statistics.mean(v) * 1e6:.0f})"
                                    for k, v in parts.items()), flush=True)
    if kv == 4 and len(sys.argv) > 3:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(64):
            nxt = mx.argmax(step(token), axis=-1)[:, None]
            mx.async_eval(nxt)
            token.tolist()
            token = nxt
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)
