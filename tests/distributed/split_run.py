"""Run under `mlx.launch` by test_launch.py: for each MODEL:MODE argument, the split model's logits
of a prompt and its greedy ids, its greedy ids and its sampled ids, seeded and unseeded, saved by every rank to
OUT/<rank>-<n>.npz (the other ranks' as a check that they fed rank 0's ids)."""

import sys

import numpy as np

import mlxllama
from mlxllama.distributed import world

PROMPT = "The capital of France is"

out = sys.argv[1]
for n, spec in enumerate(sys.argv[2:]):
    path, mode = spec.rsplit(":", 1)
    runtime = mlxllama.load(path, parallel=mode)
    ids = runtime.tokenize(PROMPT)
    logits = runtime.logits(ids)
    greedy = runtime.generate(ids, max_tokens=12).token_ids
    sampled = runtime.generate(ids, max_tokens=12, temperature=1.0, seed=7).token_ids
    unseeded = runtime.generate(ids, max_tokens=12, temperature=1.5).token_ids
    shard = runtime.model.shard
    np.savez(f"{out}/{world().rank}-{n}.npz", logits=logits, greedy=np.array(greedy), sampled=np.array(sampled),
             unseeded=np.array(unseeded),
             mode=shard.mode, layers=np.array(list(shard.layers)))
