"""The plain decode step with a block's halves compiled (mx.compile), against the step as committed
and mlx-lm's loop: tg128 at 1, 8 and 16 sequences, depths 0 and 4,096, alternating rounds in one
process (docs/benchmarks.md, "The plain step against mlx-lm"). Kept as the record of that
measurement; the variant was not kept. From the repository root, with mlx-lm importable:

    MLXLLAMA_CUDA_KERNELS=0 python benchmarks/results/h100-versus-mlx-lm/compiled-halves/host_ab.py \
        tinyllama-1.1b-Q4_K_M.gguf 5 host_ab.json

"tail": the attention's output projection, residual adds and FFN compiled; "both": the norm, Q/K/V
and RoPE too (RoPE's position as an array).
"""
import sys, statistics, types, json
sys.path.insert(0, "benchmarks")
import mlx.core as mx
from mlxllama import bench, load
from mlxllama.models import transformer as T
import versus_mlx_lm as v

path = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
runtime = load(path)
m = runtime.model
assert not m.decode_step.uses_kernels

def tail(self, x, out):
    b, l = out.shape[0], out.shape[2]
    out = self.attn_output(out.transpose(0, 2, 1, 3).reshape(b, l, -1))
    h, hc = T.residual_add(x, out)
    return T.residual_add(h, self.mlp_residual(hc))

def head(self, xc, offset):
    c = self.config
    q, k, v = self.queries_keys_values(self.attn_norm(xc))
    if k is not None:
        return self.rope(q, offset), self.rope(k, offset), v
    qk = self.rope(q, offset)
    return qk[:, : c.n_heads], qk[:, c.n_heads :], v

for blk in m.blk:
    blk._tail = mx.compile(types.MethodType(tail, blk))
    blk._head = mx.compile(types.MethodType(head, blk))
MODE = ["plain"]
orig = T.Block.__call__
def call(self, x, mask, cache, x_compute=None):
    if MODE[0] == "plain" or x.shape[1] != 1:
        return orig(self, x, mask, cache, x_compute)
    xc = x if x_compute is None else x_compute
    off = cache.offset
    if MODE[0] == "both":
        q, k, v = self._head(xc, off if isinstance(off, mx.array) else mx.array(off))
    else:
        q, k, v = head(self, xc, off)
    k, v = cache.update_and_fetch(k, v)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self._attention_scale, mask=mask)
    return self._tail(x, out)
T.Block.__call__ = call

theirs = v.MlxLm(runtime.config, m.compute_dtype)
results = []
for depth in (0, 4096):
    for batch in (1, 8, 16):
        ours_cache = m.make_cache()
        if depth:
            bench.feed(runtime, ours_cache, bench.random_ids(runtime, batch, depth, 0))
        theirs_cache = theirs.prefilled(batch, depth)
        host = {}
        def ours(mode, seed):
            MODE[0] = mode
            h = host.setdefault(mode, [])
            return batch * 128 / bench.time_generation(runtime, batch, 128, seed, depth, h, ours_cache)
        def mlxlm(seed):
            h = host.setdefault("mlx-lm", [])
            return batch * 128 / theirs.time_generation(theirs_cache, batch, 128, seed, depth, h, True)
        engines = {"plain": lambda s: ours("plain", s), "tail": lambda s: ours("tail", s),
                   "both": lambda s: ours("both", s), "mlx-lm": mlxlm}
        for f in engines.values():
            f(10_000)
        host.clear()
        samples = {k: [] for k in engines}
        order = list(engines)
        for r in range(rounds):
            for k in (order if r % 2 == 0 else order[::-1]):
                samples[k].append(engines[k](r))
        row = {"depth": depth, "batch": batch, "samples": samples,
               "host_us": {k: [statistics.median(p) * 1e6 for p in zip(*h)] for k, h in host.items()}}
        results.append(row)
        med = {k: statistics.median(s) for k, s in samples.items()}
        print(f"d={depth} b={batch}: " + ", ".join(f"{k} {x:.0f}" for k, x in med.items())
              + " | host " + ", ".join(f"{k} {'+'.join(f'{u:.0f}' for u in h)}" for k, h in row["host_us"].items()), flush=True)
        json.dump(results, open(sys.argv[3] if len(sys.argv) > 3 else "/dev/null", "w"), indent=1)
