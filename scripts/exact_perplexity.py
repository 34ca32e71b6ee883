"""The exact perplexity of a chat-tiny (llama architecture) GGUF: a plain numpy float64 forward pass.

    python scripts/exact_perplexity.py ../shared/fixtures/models/chat-tiny-*.gguf
    python scripts/exact_perplexity.py --ctx 128 --no-write ../shared/fixtures/models/chat-tiny-Q6_K.gguf

Weights are gguf.quants.dequantize's values (exactly what the quantized blocks stand for) held
in float64, and every activation stays float64: no rounding of activations to Q8 blocks as
llama.cpp's CPU matmuls do, no float32 or float16 anywhere. It is an independent check on both
mlxllama and llama.cpp (issue #7), so it uses no MLX and none of mlxllama's model code; only the
token ids come from mlxllama's tokenizer (the test checks their count against llama.cpp's).

The forward pass is llama.cpp's llama architecture: RMSNorm, RoPE on adjacent pairs (llama.cpp's
"normal" mode; the GGUF's Q and K rows are permuted for it), grouped-query attention scaled by
1/sqrt(head_dim), SwiGLU. Scoring is llama-perplexity's (as mlxllama/perplexity.py): n_ctx-token
chunks from an empty cache, BOS first, the logits at n_ctx/2 ... n_ctx-2 against the next token.

It writes the figures to tests/reference/perplexity-exact.json (merged with what is there).
"""

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TEXT = ROOT / "tests" / "fixtures" / "perplexity-corpus.txt"
OUT = ROOT / "tests" / "reference" / "perplexity-exact.json"


def load(path):
    reader = GGUFReader(path)
    field = lambda name: reader.fields[f"llama.{name}"].contents()  # noqa: E731
    hp = {"n_layers": field("block_count"), "n_heads": field("attention.head_count"),
          "n_kv_heads": field("attention.head_count_kv"), "eps": field("attention.layer_norm_rms_epsilon"),
          "rope_base": field("rope.freq_base"), "rope_dim": field("rope.dimension_count")}
    # dequantize gives (rows, row length): rows are output features, as in y = x @ w.T.
    weights = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64) for t in reader.tensors}
    return hp, weights


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x, base, dim):
    """x: (T, heads, head_dim); rotates the pairs (x[2i], x[2i+1]) of the first dim features by pos * base^(-2i/dim)."""
    pos = np.arange(x.shape[0], dtype=np.float64)[:, None, None]
    angle = pos * base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    cos, sin = np.cos(angle), np.sin(angle)
    x = x.copy()
    x0, x1 = x[..., 0:dim:2].copy(), x[..., 1:dim:2].copy()
    x[..., 0:dim:2], x[..., 1:dim:2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    return x


def hidden_states(hp, w, ids):
    """The final-normed hidden states of one sequence evaluated from position 0."""
    T = len(ids)
    x = w["token_embd.weight"][ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(hp["n_layers"]):
        b = lambda name: w[f"blk.{i}.{name}.weight"]  # noqa: E731
        h = rms_norm(x, b("attn_norm"), hp["eps"])
        q = (h @ b("attn_q").T).reshape(T, hp["n_heads"], -1)
        k = (h @ b("attn_k").T).reshape(T, hp["n_kv_heads"], -1)
        v = (h @ b("attn_v").T).reshape(T, hp["n_kv_heads"], -1)
        q, k = rope(q, hp["rope_base"], hp["rope_dim"]), rope(k, hp["rope_base"], hp["rope_dim"])
        group = hp["n_heads"] // hp["n_kv_heads"]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # query head j reads kv head j // group
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1]) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = np.einsum("hqk,khd->qhd", scores / scores.sum(-1, keepdims=True), v).reshape(T, -1)
        x = x + attn @ b("attn_output").T
        h = rms_norm(x, b("ffn_norm"), hp["eps"])
        gate = h @ b("ffn_gate").T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ b("ffn_up").T)) @ b("ffn_down").T
    return rms_norm(x, w["output_norm.weight"], hp["eps"])


def perplexity(hp, w, tokens, n_ctx, bos_id):
    first = n_ctx // 2
    nll = []
    for c in range(len(tokens) // n_ctx):
        chunk = [bos_id] + list(tokens[c * n_ctx + 1 : (c + 1) * n_ctx])
        h = hidden_states(hp, w, chunk)[first : n_ctx - 1]
        logits = h @ w.get("output.weight", w["token_embd.weight"]).T
        peak = logits.max(1, keepdims=True)
        log_probs = logits - peak - np.log(np.exp(logits - peak).sum(1, keepdims=True))
        nll.append(-log_probs[np.arange(len(h)), chunk[first + 1 :]])
    nll = np.concatenate(nll)
    ppl = math.exp(nll.mean())
    return {"ppl": ppl, "uncertainty": float(nll.std() / math.sqrt(len(nll) - 1) * ppl),
            "n_tokens": len(tokens), "n_chunks": len(tokens) // n_ctx, "n_scored": len(nll)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--ctx", type=int, action="append", help="chunk length (repeatable; default 512)")
    parser.add_argument("--no-write", action="store_true", help=f"print only; do not update {OUT.name}")
    args = parser.parse_args()
    from mlxllama import load_tokenizer
    from mlxllama.perplexity import read_text

    text = read_text(str(TEXT))
    record = json.loads(OUT.read_text()) if OUT.exists() else {"text": TEXT.name, "models": {}}
    for path in map(Path, args.models):
        tokenizer = load_tokenizer(path)
        tokens = tokenizer.encode(text, add_bos=True)
        hp, w = load(path)
        for n_ctx in args.ctx or [512]:
            result = perplexity(hp, w, tokens, n_ctx, tokenizer.bos_id)
            record["models"].setdefault(path.stem, {})[str(n_ctx)] = result
            print(f"{path.stem} ctx {n_ctx}: PPL = {result['ppl']:.6f} +/- {result['uncertainty']:.5f}", flush=True)
    if not args.no_write:
        record["models"] = dict(sorted(record["models"].items()))
        OUT.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
