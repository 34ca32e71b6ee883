"""Prefill on CUDA as the runtime now runs it, by prompt length, against mlx-lm's (chunks of 2,048),
interleaved rounds in one process; then a shape's first meetings in a fresh process.

    MLXLLAMA_CUDA_KERNELS=0 python prefill_sweep.py MODEL [--lengths 512,1024,2048,4096,8192] [--rounds 7]

Engines: ours as the runtime prefills a shape met before (the fused kernel, once planned), ours as
it prefills a shape it meets the first time (explicit products: forced for every run here), ours
always fused (as a Mac prefills), mlx-lm. Then, before any of that in the same fresh process, the
first and later prefills of a few lengths (ms): what a one-off prompt pays.
"""
import mlx.core as mx

import versus_mlx_lm
from mlxllama import bench, load
from rounds_table import arguments, print_table
from mlxllama.models.transformer import EXPLICIT, FUSED

args = arguments("512,1024,2048,4096,8192")

runtime = load(args.model)
print(f"device: {mx.default_device()}, prefill attention: {runtime.model.prefill_attention}")
print("\nFresh process, the same length fed again and again (ms, each a fresh cache):")
print("| prompt | first | second | third | fourth |")
print("| ---: | ---: | ---: | ---: | ---: |")
for n in (3000, 1000, 4096, 3000):
    print(f"| {n} | " + " | ".join(f"{1000 * bench.time_prompt(runtime, n, seed):.1f}" for seed in range(4)) + " |",
          flush=True)

theirs = versus_mlx_lm.MlxLm(runtime.config, runtime.model.compute_dtype)


def ours(how: str):
    def timer(n: int, seed: int) -> float:
        with runtime.model.attending_prefill(how):
            return n / bench.time_prompt(runtime, n, seed)
    return timer


engines = {
    "ours as the runtime, a shape met again": ours(runtime.model.prefill_attention),
    "ours as the runtime, a shape met first (explicit)": ours(EXPLICIT),
    "ours always fused (as a Mac)": ours(FUSED),
    "mlx-lm, chunks of 2,048": lambda n, seed: n / theirs.time_prompt(n, seed),
}
print(f"\n{args.rounds} rounds; tokens/s (median), ratio to mlx-lm round by round (range)")
# Two warm-ups, as the run of 2026-12-02 had (the runtime's engine plans a shape met again).
print_table(engines, args.lengths, args.rounds, "mlx-lm, chunks of 2,048", warm_ups=2)
