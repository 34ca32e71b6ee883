"""One sequence's decode through bench.time_generation on the default stream and inside a stream of its own
(mlx-lm's generate_step runs in mx.new_thread_local_stream), alternating."""
import contextlib, statistics, sys
import mlx.core as mx
from mlxllama import bench, load

rt = load(sys.argv[1])
own = mx.new_thread_local_stream(mx.default_device())
results = {"default stream": [], "own stream": []}
hosts = {"default stream": [], "own stream": []}
for rnd in range(12):
    for name in (("default stream", "own stream") if rnd % 2 == 0 else ("own stream", "default stream")):
        ctx = mx.stream(own) if name == "own stream" else contextlib.nullcontext()
        host = []
        with ctx:
            seconds = bench.time_generation(rt, 1, 128, rnd, 0, host)
        if rnd >= 2:
            results[name].append(128 / seconds)
            hosts[name].append(tuple(statistics.median(h[i] for h in host) * 1e6 for i in range(2)))
for name, v in results.items():
    print(f"{name}: median {statistics.median(v):.1f} t/s, min {min(v):.1f}, max {max(v):.1f}; host graph+launch µs",
          [f"{a:.0f}+{b:.0f}" for a, b in hosts[name]])
