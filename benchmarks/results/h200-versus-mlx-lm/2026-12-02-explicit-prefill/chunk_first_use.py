"""Full prefill chunks by MLX's fused attention, partial ones by explicit products: what it costs.

    python chunk_first_use.py MODEL

In a fresh process: every shape's products compiled first (explicit prefills of every length
below), then prompts of 512, 1,024, ... 2,560 ids, each first met and again, with full chunks
(512 new ids at a multiple of 512) fused and the rest explicit ("hybrid"): each longer prompt
adds one full chunk at a new offset, so its first use less its repeat is that chunk's plan.
Then pp512 / pp2048 / pp1100 in steady state, explicit against hybrid against fused, rounds
alternating. Milliseconds.
"""
import statistics
import sys
import time

import mlx.core as mx

import mlxllama

CHUNK = 512
runtime = mlxllama.load(sys.argv[1])
model = runtime.model


def ms(n: int, policy: str, salt: int) -> float:
    ids = [1] + [100 + (7 * i + salt) % 5000 for i in range(n - 1)]
    cache = model.make_cache()
    start = time.perf_counter()
    for at in range(0, n, CHUNK):
        chunk = ids[at : at + CHUNK]
        full = len(chunk) == CHUNK
        model.attend_prefill_explicitly(policy == "explicit" or (policy == "hybrid" and not full))
        hidden = model.hidden_states(mx.array([chunk]), cache)
        mx.eval([c.state for c in cache] if at + CHUNK < n else hidden)
    return 1000 * (time.perf_counter() - start)


lengths = [512, 1024, 1536, 2048, 2560]
for n in lengths + [1100, 700, 37]:
    ms(n, "explicit", 0), ms(n, "explicit", 1)
print("| prompt | hybrid, first | again | first less again |")
print("| ---: | ---: | ---: | ---: |")
for n in lengths:
    first, again = ms(n, "hybrid", 2), ms(n, "hybrid", 3)
    print(f"| {n} | {first:.1f} | {again:.1f} | {first - again:.1f} |", flush=True)
print()
print("| prompt | explicit | hybrid | fused | (medians of 7, ms) |")
print("| ---: | ---: | ---: | ---: | --- |")
for n in (512, 1100, 2048):
    ms(n, "fused", 4)
    times = {p: [] for p in ("explicit", "hybrid", "fused")}
    for r in range(7):
        for p in (times if r % 2 == 0 else reversed(list(times))):
            times[p].append(ms(n, p, 10 + r))
    print(f"| {n} | " + " | ".join(f"{statistics.median(t):.2f}" for t in times.values()) + " | |", flush=True)
