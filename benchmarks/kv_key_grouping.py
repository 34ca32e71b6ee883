"""How a 4-bit KV cache's keys should be grouped: perplexity with the keys quantized several ways.

`--kv-bits 4` loses far more than the 3% that #24 allows on trained models (+29% on Gemma 3 270M),
and the keys carry the loss. This script measures what would fix it, without building a cache for
each way: the cache is told to store at full precision what MLX's quantization would give back
(quantize, then dequantize), so every way runs through the same attention. Values are always
stored as `--kv-bits 4` stores them: 4 bits in groups along the head.

Ways to store the keys (`--keys`, any of):
  head        4 bits in groups along the head, as `--kv-bits 4` stores them: the script's check
              that it measures what the product does (equal to `perplexity --kv-bits 4`'s figure
              where heads are one group, as chat-tiny's, whose products dequantize; within the
              rounding of MLX's quantized products elsewhere: 23.67 against 23.93 on Gemma 3 270M)
  full        not quantized
  8           8 bits in groups along the head
  tokens      4 bits in groups of 32 positions along each channel (KIVI's per-channel keys), each
              write's keys grouped from its own first position; the cache that stores keys so,
              in blocks of fixed positions, is `--kv-keys-by-channel`
  scaled      each channel divided by the square root of its largest magnitude in the first
              pass's keys before 4 bits along the head, and multiplied back after (a SmoothQuant-like
              per-channel scale, computed once a cache)
  nvfp4       MLX's nvfp4 mode along the head: 4-bit floats (e2m1) in groups of 16 with an 8-bit
              float scale (4.5 bits a value, as affine 4 bits in groups of 32 with 16-bit scale
              and bias); a float's levels crowd near zero, where a group's values lie beside an
              outlier channel
  mxfp4       MLX's mxfp4 mode along the head: the same floats in groups of 32, a power-of-two scale
  centered    each channel's mean over the first pass's keys subtracted before 4 bits along the
              head, and added back after: a constant per channel and head adds the same q·mean to
              every score of a query, which softmax ignores, so a cache could store the centered
              keys alone; what is left to quantize is the keys' spread about their mean

    python benchmarks/kv_key_grouping.py MODEL TEXT --ctx 1024 [--keys head,full,8,tokens,scaled]

One JSON line a way: its perplexity and the rise over the unquantized cache's.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mlxllama  # noqa: E402
from mlxllama.cache import KVCache, KVQuantization  # noqa: E402
from mlxllama.errors import MlxLlamaError  # noqa: E402
from mlxllama.perplexity import perplexity, read_text  # noqa: E402

WAYS = ("head", "full", "8", "tokens", "scaled", "centered", "nvfp4", "mxfp4")
FLOAT_GROUPS = {"nvfp4": 16, "mxfp4": 32}
TOKEN_GROUP = 32


def round_trip(x: mx.array, bits: int, group_size: int) -> mx.array:
    """x as MLX's affine quantization gives it back: groups along the last axis (for the ways the
    cache's own KVQuantization does not store)."""
    return mx.dequantize(*mx.quantize(x, group_size, bits), group_size=group_size, bits=bits).astype(x.dtype)


def along_tokens(keys: mx.array, bits: int) -> mx.array:
    """Keys [batch, heads, positions, head] round-tripped in groups of TOKEN_GROUP positions of a
    channel; a last partial group is padded with its last position's values."""
    positions = keys.shape[2]
    by_channel = keys.swapaxes(2, 3)
    pad = -positions % TOKEN_GROUP
    if pad:
        by_channel = mx.concatenate([by_channel, mx.repeat(by_channel[..., -1:], pad, axis=-1)], axis=-1)
    return round_trip(by_channel, bits, TOKEN_GROUP)[..., :positions].swapaxes(2, 3)


def storing(way: str):
    """A KVCache._stored that stores keys and values at full precision as `way` would round them:
    the values, and the keys of 'head' and '8' (--kv-key-bits 8), through the cache's own
    KVQuantization."""

    def stored(cache: KVCache, keys: mx.array, values: mx.array):
        quantization = replace(cache.quantization, key_bits=8) if way == "8" else cache.quantization
        stored_keys, stored_values = quantization.decode(*quantization.encode(keys, values))
        if way == "full":
            stored_keys = keys
        elif way in FLOAT_GROUPS:
            group = FLOAT_GROUPS[way]
            stored_keys = mx.dequantize(*mx.quantize(keys, group, 4, mode=way), group_size=group, bits=4,
                                        mode=way).astype(keys.dtype)
        elif way == "tokens":
            stored_keys = along_tokens(keys, 4)
        elif way == "scaled":
            if not hasattr(cache, "channel_scale"):
                peak = mx.abs(keys.astype(mx.float32)).max(axis=2, keepdims=True)
                scale = mx.sqrt(mx.maximum(peak, 1e-6))
                cache.channel_scale = (scale / scale.mean(axis=-1, keepdims=True)).astype(keys.dtype)
            stored_keys = round_trip(keys / cache.channel_scale, 4, quantization.group_size) * cache.channel_scale
        elif way == "centered":
            if not hasattr(cache, "channel_mean"):
                cache.channel_mean = keys.astype(mx.float32).mean(axis=2, keepdims=True).astype(keys.dtype)
            stored_keys = round_trip(keys - cache.channel_mean, 4, quantization.group_size) + cache.channel_mean
        return stored_keys, stored_values, cache.offset

    return stored


def measure(model_path: str, text: str, ctx: int, way: str | None) -> float:
    runtime = mlxllama.load(model_path, context_length=ctx,
                            kv_quantization=None if way is None else KVQuantization(bits=4))
    tokens = runtime.tokenize(text, add_bos=True)
    bos = runtime.tokenizer.bos_id if runtime.tokenizer.add_bos else None
    real = KVCache._stored
    if way is not None:
        KVCache._stored = storing(way)
    try:
        return perplexity(runtime.model, tokens, ctx, bos).ppl
    finally:
        KVCache._stored = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("text")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--keys", default=",".join(WAYS), help="ways to store the keys, comma-separated")
    args = parser.parse_args()
    ways = args.keys.split(",")
    try:
        unknown = [w for w in ways if w not in WAYS]
        if unknown:
            raise MlxLlamaError(f"--keys: no way named {unknown[0]!r} (one of {', '.join(WAYS)})")
        text = read_text(args.text)
        unquantized = measure(args.model, text, args.ctx, None)
        print(json.dumps({"keys": "unquantized", "ppl": round(unquantized, 4)}), flush=True)
        for way in ways:
            ppl = measure(args.model, text, args.ctx, way)
            print(json.dumps({"keys": way, "ppl": round(ppl, 4), "rise": round(ppl / unquantized - 1, 4)}), flush=True)
    except MlxLlamaError as e:
        sys.exit(f"kv_key_grouping.py: error: {e}")


if __name__ == "__main__":
    main()
