"""A one-off prompt: a fresh process's first prefill of N random ids, then the same length again
(and a third time), for ours as the runtime prefills or for mlx-lm (chunks of 2,048); milliseconds.

    MLXLLAMA_CUDA_KERNELS=0 python one_off.py MODEL (ours|mlx-lm) N

What a user's `generate` with a long prompt waits for (after the model is loaded): everything the
first use of each kernel costs, cuDNN's plans included where an engine uses them.
"""
import sys

import versus_mlx_lm
from mlxllama import bench, load

path, engine, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
runtime = load(path)
if engine == "mlx-lm":
    theirs = versus_mlx_lm.MlxLm(runtime.config, runtime.model.compute_dtype)
    timed = [theirs.time_prompt(n, seed) for seed in range(3)]
else:
    timed = [bench.time_prompt(runtime, n, seed) for seed in range(3)]
print(f"| {engine} | {n} | " + " | ".join(f"{1000 * t:.1f}" for t in timed) + " |", flush=True)
