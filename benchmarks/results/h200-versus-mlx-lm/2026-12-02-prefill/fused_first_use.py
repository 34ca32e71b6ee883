"""What a prompt of a new length costs the first time, attended explicitly and by MLX's fused kernel.

    python benchmarks/results/h200-versus-mlx-lm/2026-12-02-prefill/fused_first_use.py MODEL [LENGTHS]

For each new length: the explicit prefill first met, again, then the fused prefill first met (the
products already met at that length, so only the attention is new), and again; milliseconds.
"""
import sys
import time

import mlx.core as mx

import mlxllama
from mlxllama.generate import prefill

runtime = mlxllama.load(sys.argv[1])
model = runtime.model
lengths = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "37,100,137,171,230,333,420,512,700,1100").split(",")]


def ms(n: int, explicit: bool, salt: int) -> float:
    model.attend_prefill_explicitly(explicit)
    ids = [1] + [100 + (7 * i + salt) % 5000 for i in range(n - 1)]
    cache = model.make_cache()
    start = time.perf_counter()
    mx.eval(prefill(model, ids, cache))
    return 1000 * (time.perf_counter() - start)


ms(16, True, 0), ms(16, False, 0)
print("| new tokens | explicit, first | again | fused, first | again | the fused kernel's first use less its repeat |")
print("| ---: | ---: | ---: | ---: | ---: | ---: |")
for n in lengths:
    e1, e2, f1, f2 = ms(n, True, 1), ms(n, True, 2), ms(n, False, 3), ms(n, False, 4)
    print(f"| {n} | {e1:.1f} | {e2:.1f} | {f1:.1f} | {f2:.1f} | {f1 - f2:.1f} |", flush=True)
