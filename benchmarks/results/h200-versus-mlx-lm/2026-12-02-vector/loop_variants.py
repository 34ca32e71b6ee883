import statistics, sys, json
import mlx.core as mx
from mlxllama import bench, load
from versus_mlx_lm import filled_ours, random_ids

rt = load(sys.argv[1]); rounds = int(sys.argv[2]); out = {}
stream = mx.new_stream(mx.default_device())
def call(tokens, cache): return rt.model(tokens, cache=cache)[:, -1]
variants = {"step": (rt.model.step, None), "step+stream": (rt.model.step, stream),
            "call": (call, None), "call+stream": (call, stream)}
for depth in (0, 4096, 8192):
    caches = {n: filled_ours(rt, 1, depth, 128) for n in variants}
    speeds = {n: [] for n in variants}
    for r in range(rounds + 1):
        order = list(variants) if r % 2 else list(reversed(variants))
        for n in order:
            fn, s = variants[n]
            token = random_ids(rt.config.vocab_size, 1, 1, r)
            c = caches[n]
            if s is None:
                sec = bench.time_steps(lambda t: fn(t, c), token, 128)
            else:
                with mx.stream(s):
                    sec = bench.time_steps(lambda t: fn(t, c), token, 128)
            bench.cut_back(c, depth)
            if r: speeds[n].append(128 / sec)
    base = speeds["step"]
    for n, v in speeds.items():
        ratios = [a / b for a, b in zip(v, base)]
        print(f"d={depth} {n}: median {statistics.median(v):.1f} t/s, vs step round by round {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    out[depth] = speeds
json.dump(out, open(sys.argv[3], "w"))
