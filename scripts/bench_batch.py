"""Aggregate generation throughput of batched decoding at several batch sizes.

Runs the same raw prompts (greedy, no template, no stop ids) one at a time with `Runtime.generate`, then with
`batch_generate` at each batch size, and prints a table; the ids must be the same in every run.
Throughput counts generated tokens over the whole run's wall time, prefill included; the CPU
seconds (all threads) show the cost when other work shares the machine and wall time is unreliable.

    python scripts/bench_batch.py [--model GGUF] [--prompts 16] [--max-tokens 64] [--batch-sizes 1,8,16]
"""

from __future__ import annotations

import argparse
import time

import mlxllama
from mlxllama.cli import default_model_path

OPENINGS = ["The capital of Italy is", "Once upon a time", "1, 2, 3, 4,", "The quick brown fox",
            "In the beginning", "My favourite food is", "Water boils at", "The best way to learn is"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: as the mlxllama command)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,8,16")
    args = parser.parse_args()
    runtime = mlxllama.load(args.model or default_model_path())
    # Prompts of different lengths: an opening said once, twice or three times.
    prompts = [" ".join([OPENINGS[i % len(OPENINGS)]] * (1 + i % 3)) for i in range(args.prompts)]
    # No stop ids, so every prompt generates exactly max-tokens tokens and every run decodes the same work.
    runtime.tokenizer.stop_ids = frozenset()
    runtime.generate(prompts[0], max_tokens=4)  # warm-up

    def one_at_a_time():
        return [runtime.generate(p, max_tokens=args.max_tokens) for p in prompts]

    def batched(size):
        return lambda: mlxllama.batch_generate(runtime, prompts, max_tokens=args.max_tokens, batch_size=size)

    runs = [("one at a time", one_at_a_time)]
    runs += [(f"batch {size}", batched(size)) for size in map(int, args.batch_sizes.split(","))]
    print(f"{'run':<13} {'prompts':>7} {'gen tokens':>10} {'seconds':>8} {'tokens/s':>8} {'cpu s':>7} {'same ids':>8}")
    reference = None
    for name, run in runs:
        start, cpu_start = time.perf_counter(), time.process_time()
        ids = [r.token_ids for r in run()]
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        reference = reference or ids
        generated = sum(map(len, ids))
        print(f"{name:<13} {len(prompts):>7} {generated:>10} {seconds:>8.2f} {generated / seconds:>8.1f} "
              f"{cpu:>7.2f} {'yes' if ids == reference else 'NO':>8}")


if __name__ == "__main__":
    main()
