"""The device kernels of decode steps or of prefills, as CUPTI records them (through PyTorch's profiler, which the GPU machine has).

    python benchmarks/kernel_trace.py MODEL.gguf [--context 512] [--steps 20] [--mlx-lm] [--json OUT]
    python benchmarks/kernel_trace.py MODEL.gguf --prefill 512 [--steps 5] [--mlx-lm | --fused-prefill] [--json OUT]

Prints kernels per step, the device's busy time per step (the sum of kernel durations) against
the wall time per step, the kernels that take the most time, and the host's CUDA runtime and
driver calls (µs and calls a step, by name). Run it with
MLXLLAMA_CUDA_KERNELS=0 to see the plain step, and with --mlx-lm to see mlx-lm's step on a model of
the file's shape (benchmarks/versus_mlx_lm.py's). With --prefill N a "step" is the prefill of N
random ids into an empty cache, as versus_mlx_lm.py times pp<N> (its `feed`, in chunks); our prefill
attends by explicit products, as CUDA's runtime attends a shape the first time it meets it, or with
MLX's fused kernel under --fused-prefill, as it attends a shape met again (and every other backend,
always: Transformer.attend_prefill).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

try:
    import torch  # imported first: its CUDA libraries and CUPTI
    from torch.profiler import ProfilerActivity, profile
except ImportError:
    print("kernel_trace.py: needs PyTorch, whose profiler reads CUPTI (the GPU machine's image has it)", file=sys.stderr)
    sys.exit(2)

import mlx.core as mx

import mlxllama
from mlxllama import bench
from mlxllama.errors import MlxLlamaError
from mlxllama.models.transformer import EXPLICIT, FUSED
from versus_mlx_lm import MlxLm


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mlx-lm", action="store_true")
    parser.add_argument("--prefill", type=int, metavar="N", help="trace prefills of N ids, not decode steps")
    parser.add_argument("--fused-prefill", action="store_true", help="our prefill with MLX's fused attention")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    try:
        runtime = mlxllama.load(args.model)
    except MlxLlamaError as e:
        print(f"kernel_trace.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    model = runtime.model
    theirs = None
    if args.mlx_lm:
        theirs = MlxLm(runtime.config, model.compute_dtype)
    if args.prefill:
        model.attend_prefill(FUSED if args.fused_prefill else EXPLICIT)
        traced_steps = prefills(runtime, theirs, args.prefill)
    else:
        traced_steps = decode_steps(runtime, theirs, args.context)
    traced_steps(args.steps)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        traced_steps(args.steps)
        wall = (time.perf_counter() - start) / args.steps
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        traced = json.load(open(path))["traceEvents"]
    summary(args, model, traced, wall)


def prefills(runtime, theirs, n_prompt: int):
    """A function that prefills `steps` times n_prompt random ids, each into an empty cache, as
    versus_mlx_lm.py's pp test times each engine."""
    prefill = (lambda seed: bench.time_prompt(runtime, n_prompt, seed)) if theirs is None else (
        lambda seed: theirs.time_prompt(n_prompt, seed))

    def run(steps: int) -> None:
        for seed in range(steps):
            prefill(seed)

    return run


def decode_steps(runtime, theirs, context: int):
    """A function that decodes `steps` steps after `context` cached ids, one step ahead of the host,
    and cuts the cache back to them."""
    if theirs is not None:
        cache = theirs.make_cache()
        step = lambda tokens, kv: theirs.model(tokens, cache=kv)[:, -1]  # noqa: E731
    else:
        cache = runtime.model.make_cache()
        step = runtime.model.step
    mx.eval(step(mx.array([[1] * context]), cache))
    token = mx.array([[1]])

    def decode(steps: int) -> None:
        out = step(token, cache)
        mx.async_eval(out)
        for _ in range(steps - 1):
            nxt = step(token, cache)
            mx.async_eval(nxt)
            mx.eval(out)
            out = nxt
        mx.eval(out)
        for layer in cache:
            layer.trim(steps)

    return decode


def summary(args, model, traced: list[dict], wall: float) -> None:
    """Prints (and writes to --json) the trace's kernels and CUDA calls a step."""
    events = [e for e in traced if e.get("cat") == "kernel"]
    # The host's side of the launches: what each CUDA runtime and driver call costs the thread that makes it.
    api_us = collections.Counter()
    api_calls = collections.Counter()
    for e in traced:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            api_us[e["name"]] += e.get("dur", 0) / args.steps
            api_calls[e["name"]] += 1 / args.steps
    busy = sum(e["dur"] for e in events) / args.steps
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / args.steps if events else 0
    by_name = collections.Counter()
    counts = collections.Counter()
    for e in events:
        by_name[e["name"][:90]] += e["dur"] / args.steps
        counts[e["name"][:90]] += 1 / args.steps
    result = {
        "model": args.model, "kernels": model.decode_step.uses_kernels, "context": args.context,
        "step": ("mlx-lm" if args.mlx_lm else "model.step") if not args.prefill else
                f"prefill {args.prefill}: " + ("mlx-lm" if args.mlx_lm else "fused" if args.fused_prefill else "explicit"),
        "kernels_per_step": len(events) / args.steps, "busy_us_per_step": round(busy, 1),
        "span_us_per_step": round(span, 1), "wall_us_per_step": round(wall * 1e6, 1),
        "top": [(name, round(us, 1), round(counts[name], 1)) for name, us in by_name.most_common(40)],
        "api_us_per_step": round(sum(api_us.values()), 1),
        "api": [(name, round(us, 1), round(api_calls[name], 1)) for name, us in api_us.most_common(20)],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
