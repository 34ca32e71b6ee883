"""Probe: the kernel step at depths that take 1, 2, 4 and 16 teams a group, against the plain step."""
import faulthandler
import sys
import time

import mlx.core as mx
import numpy as np

import mlxllama
from mlxllama.models.transformer import EXPLICIT

faulthandler.dump_traceback_later(240, exit=True)
rt = mlxllama.load(sys.argv[1])
model, step = rt.model, rt.model.decode_step
print(type(step).__name__, "blocks", getattr(step, "blocks", None), flush=True)
for n in [int(v) for v in sys.argv[2].split(",")]:
    ids = np.random.default_rng(n).integers(3, rt.config.vocab_size, n).tolist()
    caches = model.make_cache(), model.make_cache()
    with model.attending_prefill(EXPLICIT):
        for cache in caches:
            model(mx.array([ids]), cache)
    mx.eval([c.keys for c in caches[0]] if hasattr(caches[0][0], "keys") else [])
    token = mx.array([[ids[-1]]])
    t = time.time()
    got = np.array(step(token, caches[0])[0], dtype=np.float32)
    dt = time.time() - t
    want = np.array(step.fallback(token, caches[1])[0], dtype=np.float32)
    print(f"n={n} step {dt:.2f}s max|diff| {np.abs(got - want).max():.4f} argmax {got.argmax()} {want.argmax()}",
          flush=True)
    faulthandler.cancel_dump_traceback_later()
    faulthandler.dump_traceback_later(240, exit=True)
