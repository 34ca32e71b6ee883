"""Where one decode step's time goes (batch 1, a cache of --context tokens).

    python benchmarks/profile_decode.py MODEL.gguf [--dequantize] [--context 512] [--reps 20] [--json OUT]

Times, each the median of repeated runs after a warm-up:
  step       one whole (compiled) decode step, evaluated synchronously (host work + device work)
  pipelined  the same step with the next one queued before waiting, as generation runs it
  host       the host's part of a step: the compiled step's call, with no evaluation
  linear     every projection of the step (5 to 7 per layer, fusion.py), each kernel alone
  lm_head    the output projection
  attention  RoPE and fused attention over the cache, every layer
  other      what is left: norms, activations, residual adds, embedding lookup, launch gaps
and the floor: the bytes of weights a step must read over a measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import mlx.nn as nn

import mlxllama

def median_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernels_seconds(make_outputs, copies: int) -> float:
    """Device time of one set of outputs: `copies` independent sets in one evaluation, divided."""
    return median_seconds(lambda: mx.eval([make_outputs() for _ in range(copies)]), reps=3) / copies


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a large device copy."""
    src = mx.random.uniform(shape=(64 * 2**20,))  # 256 MiB
    mx.eval(src)
    seconds = median_seconds(lambda: mx.eval(src * 1), reps=5)
    return 2 * src.nbytes / seconds


def layer_bytes(layer: nn.Module) -> int:
    return sum(v.nbytes for _, v in nn.utils.tree_flatten(layer.parameters()))


def profile(path: str, dequantize: bool, context: int, reps: int) -> dict:
    runtime = mlxllama.load(path, dequantize=dequantize)
    model, config = runtime.model, runtime.config
    cache = model.make_cache()
    mx.eval(model(mx.array([[1] * context]), cache))
    token = mx.array([[1]])

    def step():
        out = model.step(token, cache)
        for c in cache:
            c.trim(1)
        return out

    timings = {"step": median_seconds(lambda: mx.eval(step()), reps)}

    def pipelined():
        out = step()
        mx.async_eval(out)
        for _ in range(reps - 1):
            nxt = step()
            mx.async_eval(nxt)
            mx.eval(out)
            out = nxt
        mx.eval(out)

    timings["pipelined"] = median_seconds(pipelined, reps=3) / reps
    timings["host"] = median_seconds(lambda: step(), reps)
    mx.eval([c.state for c in cache])

    dtype = model.compute_dtype
    x = mx.random.normal((1, 1, config.hidden_size)).astype(dtype)
    x_ffn = mx.random.normal((1, 1, config.ffn_size)).astype(dtype)
    linear = 0.0
    for block in model.blk:
        layers = [m for name, m in block.children().items() if "norm" not in name and name != "ffn_down"]
        linear += kernels_seconds(lambda: [f(x) for f in layers] + [block.ffn_down(x_ffn)], reps)
    timings["linear"] = linear
    head_layer = model.token_embd if config.tied_output else model.output
    head = head_layer.as_linear if config.tied_output else head_layer
    timings["lm_head"] = kernels_seconds(lambda: head(x), reps)

    q = mx.random.normal((1, config.n_heads, 1, config.head_dim)).astype(dtype)
    k_new = mx.random.normal((1, config.n_kv_heads, 1, config.head_dim)).astype(dtype)
    kv_cache = mx.random.normal((1, config.n_kv_heads, context, config.head_dim)).astype(dtype)

    def attention():
        rope = dict(traditional=config.rope_traditional, base=config.rope_base, scale=1.0, offset=context)
        return [mx.fast.rope(k_new, config.rope_dim, **rope),
                mx.fast.scaled_dot_product_attention(mx.fast.rope(q, config.rope_dim, **rope), kv_cache, kv_cache,
                                                     scale=config.head_dim**-0.5)]

    timings["attention"] = config.n_layers * kernels_seconds(attention, reps)
    timings["other"] = timings["step"] - timings["linear"] - timings["lm_head"] - timings["attention"]
    weight_bytes = sum(layer_bytes(b) for b in model.blk) + layer_bytes(head_layer)
    bandwidth = copy_bandwidth()
    return {
        "model": path, "mode": "dequantize" if dequantize else "native", "context": context,
        "device": str(mx.default_device()), "ms": {k: round(v * 1e3, 4) for k, v in timings.items()},
        "weight_bytes_per_step": weight_bytes, "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "floor_ms": round(weight_bytes / bandwidth * 1e3, 4),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dequantize", action="store_true")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--reps", type=int, default=20, help="Repetitions (and copies per kernel timing).")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    result = profile(args.model, args.dequantize, args.context, args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{result['mode']} on {result['device']}, context {args.context}: "
          + ", ".join(f"{k} {v:.3f} ms" for k, v in result["ms"].items())
          + f"; floor {result['floor_ms']:.3f} ms ({result['weight_bytes_per_step'] / 2**20:.0f} MiB at "
          f"{result['copy_bandwidth_GBps']} GB/s)")


if __name__ == "__main__":
    main()
