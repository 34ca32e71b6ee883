"""What one all-reduce of a split model's hidden states costs inside a step, under `mlx.launch`.

    mlx.launch -n 2 --backend nccl -- python benchmarks/allreduce_cost.py [--hidden 2048,4096] [--rows 1,16,512] [--json F]

A tensor-parallel step makes two all-reduces a layer, each of [rows, hidden] float16 (rows: the
sequences decoded together, or a prefill's tokens). This chains 2 x 22 of them in one graph, as a
TinyLlama step does, with a scaling between them (the step's own work is far larger), and
subtracts the same chain without the all-reduces: the difference per all-reduce is what a layer's
exchange adds to a token. Rank 0 prints one line a shape.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx


def chain_seconds(rows: int, hidden: int, count: int, group, reduce: bool, repeats: int) -> float:
    x = mx.ones((rows, hidden), dtype=mx.float16)
    scale = 1.0 / group.size()

    def once() -> mx.array:
        h = x
        for _ in range(count):
            h = h * scale
            if reduce:
                h = mx.distributed.all_sum(h, group=group)
        return h

    mx.eval(once())  # first use: kernels loaded, communicator warmed
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(once())
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", default="2048,4096")
    parser.add_argument("--rows", default="1,16,512")
    parser.add_argument("--count", type=int, default=44, help="all-reduces chained (2 a layer)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    group = mx.distributed.init()
    results = []
    for hidden in map(int, args.hidden.split(",")):
        for rows in map(int, args.rows.split(",")):
            with_reduce = chain_seconds(rows, hidden, args.count, group, True, args.repeats)
            without = chain_seconds(rows, hidden, args.count, group, False, args.repeats)
            result = {"ranks": group.size(), "rows": rows, "hidden": hidden, "chained": args.count,
                      "chain_ms": with_reduce * 1e3, "chain_without_ms": without * 1e3,
                      "per_all_reduce_us": (with_reduce - without) / args.count * 1e6}
            results.append(result)
            if group.rank() == 0:
                print(f"{group.size()} ranks, [{rows}, {hidden}] float16: {result['per_all_reduce_us']:.1f} us an "
                      f"all-reduce ({args.count} chained: {result['chain_ms']:.3f} ms, "
                      f"{result['chain_without_ms']:.3f} ms without)")
    if group.rank() == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
