"""The host's time to build one decode step's graph, our plain step against mlx-lm's model, on any machine.

    pip install --no-deps mlx-lm==0.32.2
    python benchmarks/graph_build.py MODEL.gguf [--batch 1] [--depth 256] [--reps 50] [--rounds 5] [--profile N]

A decode step of a 1B model is bound by the host on a GPU (docs/benchmarks.md, "The plain step
against mlx-lm"), and the Python half of the host's time is building the step's graph. This builds
that graph again and again without evaluating it, so it can be timed on a machine without the GPU:
our model loaded as a GPU holds it (the affine form in float16, not the CPU's sub-block form), and
mlx-lm's model of the same shape (versus_mlx_lm.MlxLm), each over a cache of random keys and values
at --depth. MLX's fused operations (RoPE, RMSNorm, attention) are stood in for by one primitive each:
on the CPU they would build their fallbacks' many primitives, which a GPU never builds. For each of
--rounds it prints the median µs of --reps builds of each engine; with --profile, Python's
profiler's N functions with the most time of their own, per build.
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import sys
import time

import mlx.core as mx

from mlxllama import bench
from mlxllama.errors import MlxLlamaError
from mlxllama.runtime import read_header
from mlxllama.weights import load_model
from host_profile import profile_lines, top_functions
from versus_mlx_lm import MlxLm, filled_ours


def stand_in_fused_operations() -> None:
    """mx.fast's RoPE, RMSNorm and attention as one primitive each, of the shape each returns."""
    mx.fast.rope = lambda x, *args, **kwargs: mx.abs(x)
    mx.fast.rms_norm = lambda x, weight, eps: x * weight
    mx.fast.scaled_dot_product_attention = lambda q, k, v, **kwargs: mx.abs(q)


class GpuForm:
    """Our model as load() holds it on a GPU, without the CUDA kernels: what bench's helpers take."""

    def __init__(self, path: str):
        gguf, architecture, self.config, _ = read_header(path)
        self.model = load_model(gguf, architecture, self.config, mx.float16, native=True, shard=None,
                                requantize=True, block_products=None, sub_blocks=False, wide=True)
        mx.eval(self.model.parameters())


def build_seconds(step, token: mx.array, cache: list, depth: int, reps: int) -> list[float]:
    """Seconds to build the step's graph (to its greedy token), `reps` times, the cache cut back after each."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.argmax(step(token), axis=-1)
        times.append(time.perf_counter() - start)
        bench.cut_back(cache, depth)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--depth", type=int, default=256)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    try:
        ours = GpuForm(args.model)
    except MlxLlamaError as e:
        print(f"graph_build.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    theirs = MlxLm(ours.config, mx.float16)
    stand_in_fused_operations()
    token = mx.array([[5]] * args.batch)
    # Room for every build: the cache is cut back after each, but its buffers are sized once.
    ours_cache = filled_ours(ours, args.batch, args.depth, 1)
    theirs_cache = theirs.filled(args.batch, args.depth, 1, mx.float16)
    engines = {"ours": (lambda t: ours.model.step(t, ours_cache), ours_cache),
               "mlx-lm": (lambda t: theirs.model(t, cache=theirs_cache)[:, -1], theirs_cache)}
    medians = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, (step, cache) in engines.items():
            medians[name].append(statistics.median(build_seconds(step, token, cache, args.depth, args.reps)) * 1e6)
    for name, runs in medians.items():
        print(f"{name}: µs a build, median of each round: {', '.join(f'{m:.0f}' for m in runs)}"
              f" (fastest {min(runs):.0f})")
    for name, (step, cache) in engines.items() if args.profile else ():
        profiler = cProfile.Profile()
        profiler.enable()
        build_seconds(step, token, cache, args.depth, args.reps)
        profiler.disable()
        print(f"\n{name}, under cProfile, µs a build (own, with callees), calls a build:")
        print("\n".join(profile_lines(top_functions(profiler, args.reps, args.profile))))


if __name__ == "__main__":
    main()
