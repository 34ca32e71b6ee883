"""The prompt cache's store evaluated at once (mx.eval, as committed) or queued (mx.async_eval), under
continuous batching of short requests, alternating, one process."""
import statistics, sys, time
import mlx.core as mx
from mlxllama import load, synthetic
import mlxllama.prompt_cache as pc
from mlxllama.batching import BatchDecoder, Request
path = sys.argv[1]
rt = load(path)
texts = ["What is the capital of Japan?", "What is the capital of France?", "Tell me about cats.", "Name a color.",
         "What is two plus two?", "Who wrote Hamlet?", "Where is Peru?", "Why is the sky blue?"]
prompts = [rt.tokenizer.encode(t * 2, add_bos=True) for t in texts]
print("prompt lengths", [len(p) for p in prompts], flush=True)
def run(n_requests, max_tokens=32):
    dec = BatchDecoder(rt.model, rt.tokenizer, 16, 512, pc.PromptCache(256 << 20), stepped_rests=True, group=False)
    sent = done = steps = 0
    t = time.perf_counter()
    while done < n_requests:
        while dec.room and sent < n_requests:
            dec.admit(sent, Request(prompts[sent % len(prompts)], max_tokens + 7 * (sent % 3))); sent += 1
        while dec.joining:
            done += len(dec.prefill_chunk())
        done += len(dec.step()); steps += 1
    return time.perf_counter() - t, steps
committed = pc.PromptCache.store
def queued(self, ids, layers):
    ids = tuple(ids)
    copies = [tuple(pc.kv_map(lambda a: mx.contiguous(a[:, :, : len(ids)]), b) for b in layer) for layer in layers]
    mx.async_eval(copies)
    self._add(ids, copies)
t0 = time.perf_counter(); print("warm-up", run(48), round(time.perf_counter() - t0, 1), "s", flush=True)
res = {"eval": [], "async_eval": []}
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
    for k in (["eval", "async_eval"] if r % 2 == 0 else ["async_eval", "eval"]):
        pc.PromptCache.store = committed if k == "eval" else queued
        seconds, steps = run(128)
        res[k].append(seconds)
        print(k, round(seconds, 3), "s", steps, "steps", flush=True)
for k, v in res.items():
    print(k, "median", round(statistics.median(v), 3), "s for 128 requests")
