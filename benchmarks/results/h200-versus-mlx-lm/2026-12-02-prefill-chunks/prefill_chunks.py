"""CUDA's prefill by chunk size: ours explicit (as CUDA prefills) in chunks of 512 and 2,048 (the
latter with its queries in blocks of 512, and whole), ours fused (as a Mac prefills) and mlx-lm's,
each in chunks of 512 and of 2,048 (mlx-lm's generate_step default), interleaved rounds in one process.

    MLXLLAMA_CUDA_KERNELS=0 python prefill_chunks.py MODEL [--lengths 512,1024,2048,4096] [--rounds 7]

Prints tokens/s medians and each engine's ratio round by round to mlx-lm in chunks of 2,048.
"""
import mlx.core as mx

import versus_mlx_lm
from mlxllama import bench, load
from rounds_table import arguments, print_table
from mlxllama.models import transformer

args = arguments("512,1024,2048,4096")

runtime = load(args.model)
theirs = versus_mlx_lm.MlxLm(runtime.config, runtime.model.compute_dtype)


def ours(chunk: int, explicit: bool, block: int = 512):
    def timer(n: int, seed: int) -> float:
        bench.PREFILL_CHUNK, transformer.EXPLICIT_QUERY_BLOCK = chunk, block
        runtime.model.attend_prefill_explicitly(explicit)
        try:
            return n / bench.time_prompt(runtime, n, seed)
        finally:
            bench.PREFILL_CHUNK, transformer.EXPLICIT_QUERY_BLOCK = 512, 512
            runtime.model.attend_prefill_explicitly(True)
    return timer


def mlx_lm(chunk: int):
    def timer(n: int, seed: int) -> float:
        versus_mlx_lm.PREFILL_CHUNK = chunk
        try:
            return n / theirs.time_prompt(n, seed)
        finally:
            versus_mlx_lm.PREFILL_CHUNK = 512
    return timer


engines = {
    "ours explicit, 512": ours(512, True),
    "ours explicit, 2048 in blocks of 512": ours(2048, True),
    "ours explicit, 2048 whole": ours(2048, True, 1 << 30),
    "ours fused, 512": ours(512, False),
    "ours fused, 2048": ours(2048, False),
    "mlx-lm, 512": mlx_lm(512),
    "mlx-lm, 2048": mlx_lm(2048),
}
print(f"device: {mx.default_device()}, {args.rounds} rounds, tokens/s (median) and ratio to mlx-lm in chunks of "
      "2,048, round by round (range)")
print_table(engines, args.lengths, args.rounds, "mlx-lm, 2048")
