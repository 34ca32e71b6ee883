"""Run under `mlx.launch` by test_launch.py: for each MODEL:MODE argument (MODE "pipeline-sum": a
pipeline whose stages hand over by all-sums, as NCCL's must), the split model's logits
of a prompt and its greedy ids, its greedy ids and its sampled ids, seeded and unseeded, saved by every rank to
OUT/<rank>-<n>.npz (the other ranks' as a check that they fed rank 0's ids). Both sides compute
in float32, the CPU's default: on a GPU (float16 by default) the split's reordered sums would move
the logits by more than the float32 tolerance these tests hold them to."""

import dataclasses
import sys

import mlx.core as mx
import numpy as np

import mlxllama
from mlxllama.distributed import world

PROMPT = "The capital of France is"

out = sys.argv[1]
for n, spec in enumerate(sys.argv[2:]):
    path, mode = spec.rsplit(":", 1)
    runtime = mlxllama.load(path, parallel=mode.removesuffix("-sum"), dtype=mx.float32)
    if mode.endswith("-sum"):  # the stages hand over by all-sums, as on CUDA (runtime.plan_parallel)
        runtime.model.shard = dataclasses.replace(runtime.model.shard, hand_over="sum")
    ids = runtime.tokenize(PROMPT)
    logits = runtime.logits(ids)
    greedy = runtime.generate(ids, max_tokens=12).token_ids
    sampled = runtime.generate(ids, max_tokens=12, temperature=1.0, seed=7).token_ids
    unseeded = runtime.generate(ids, max_tokens=12, temperature=1.5).token_ids
    shard = runtime.model.shard
    np.savez(f"{out}/{world().rank}-{n}.npz", logits=logits, greedy=np.array(greedy), sampled=np.array(sampled),
             unseeded=np.array(unseeded),
             mode=shard.mode, hand_over=shard.hand_over, layers=np.array(list(shard.layers)))
