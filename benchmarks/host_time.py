"""How a decode step's time splits between the host and the wait for the device.

    python benchmarks/host_time.py MODEL.gguf [--reps 12] [--tokens 128] [--json OUT]

Decodes --tokens greedy steps after a one-token start, --reps times in one process, as
bench.time_generation does (the host takes each token one step behind). For each repetition it
prints tokens/s, the host's time a step (building the step and handing it to the device:
model.step, argmax, mx.async_eval) and the time a step waits for the previous token. When the
host's time is the larger part of a step, the host bounds the speed, not the GPU.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from mlxllama import load
from mlxllama.errors import MlxLlamaError


def run(runtime, first_token: int, tokens: int) -> tuple[float, float, float]:
    """tokens/s, host µs a step, wait µs a step."""
    model = runtime.model
    cache = model.make_cache()
    token = mx.argmax(model(mx.array([[first_token]]), cache)[:, -1:], axis=-1)
    mx.eval(token)
    host = wait = 0.0
    start = time.perf_counter()
    for _ in range(tokens):
        a = time.perf_counter()
        next_token = mx.argmax(model.step(token, cache), axis=-1)[:, None]
        mx.async_eval(next_token)
        b = time.perf_counter()
        token.tolist()
        wait += time.perf_counter() - b
        host += b - a
        token = next_token
    token.tolist()
    seconds = time.perf_counter() - start
    return tokens / seconds, host / tokens * 1e6, wait / tokens * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", metavar="OUT", help="also write the repetitions to OUT as JSON")
    args = parser.parse_args()
    runtime = load(args.model)
    run(runtime, 5, args.tokens)  # warm-up: compiles the step
    print("rep  tokens/s  host µs/step  wait µs/step")
    reps = []
    for rep in range(args.reps):
        speed, host, wait = run(runtime, 6 + rep, args.tokens)
        reps.append({"tokens_per_second": speed, "host_us_per_step": host, "wait_us_per_step": wait})
        print(f"{rep:3d}  {speed:8.1f}  {host:12.0f}  {wait:12.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "reps": reps}, f, indent=1)


if __name__ == "__main__":
    try:
        main()
    except MlxLlamaError as error:
        raise SystemExit(f"host_time.py: {error}")
