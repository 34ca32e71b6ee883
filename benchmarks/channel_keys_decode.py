"""What decoding keys stored by channel (--kv-keys-by-channel) costs a layer, and two alternatives.

Attention decodes such keys before its products (cache.channel_blocks_decoded: mx.dequantize over
the buffer's blocks turned [head_dim, positions], then turned back). The alternative, `fused`,
unpacks the codes itself in one compiled function whose last operation writes the keys in
position order, so that no copy follows. Both give the same keys to the bit (checked here).
Times one layer's keys of the TinyLlama shape (4 KV heads of 64) at a depth, in float16:

    python benchmarks/channel_keys_decode.py [--depth 8192] [--runs 200] [--attention]

`--attention` times a layer's whole attention of one query (32 heads) instead: `shipped` decodes
the keys (and the 4-bit values) and runs MLX's fused kernel; `block products` scores each block
of keys with MLX's quantized product as stored (its [head_dim, positions] codes one batch of
`mx.quantized_matmul(..., transpose=False)`), then weights the values with another, as the cache
along the head is attended. The two outputs' largest difference is printed.

`--patch`, before `-m mlxllama ...`'s arguments, runs mlxllama with the fused decoding instead:

    python benchmarks/channel_keys_decode.py --patch bench -m FILE --kv-bits 4 --kv-keys-by-channel -b 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mlxllama import cache  # noqa: E402


@mx.compile
def decoded_fused(codes: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
    """cache.channel_blocks_decoded for 4-bit codes, unpacked by shifts in one compiled function."""
    batch, heads, slots, _ = codes.shape
    blocks, head_dim = slots // cache.CHANNEL_BLOCK, scales.shape[-1] * cache.CHANNEL_BLOCK
    words = codes.reshape(batch, heads, blocks, head_dim, -1)
    values = (words[..., None] >> (mx.arange(8, dtype=mx.uint32) * 4)) & 15
    values = values.reshape(batch, heads, blocks, head_dim, cache.CHANNEL_BLOCK)
    scales, biases = (a.reshape(batch, heads, blocks, head_dim, 1) for a in (scales, biases))
    return (values.astype(scales.dtype) * scales + biases).swapaxes(3, 4).reshape(batch, heads, slots, head_dim)


def attention_by_block_products(q: mx.array, keys: tuple, values: tuple, scale: float) -> mx.array:
    """Attention of q [1, heads, 1, head_dim] over keys stored by channel (whole blocks) and values
    in 4 bits along the head (groups of 32), every product quantized, scores in float32."""
    batch, heads, _, head_dim = q.shape
    kv_heads, slots = keys[0].shape[1:3]
    groups, blocks = heads // kv_heads, slots // cache.CHANNEL_BLOCK
    per_block = [a.reshape(batch, kv_heads, blocks, head_dim, -1) for a in keys]
    q = q.reshape(batch, kv_heads, 1, groups, head_dim) * scale
    scores = mx.quantized_matmul(q, *per_block, transpose=False, group_size=cache.CHANNEL_BLOCK, bits=4)
    scores = scores.transpose(0, 1, 3, 2, 4).reshape(batch, kv_heads, groups, 1, slots).astype(mx.float32)
    weights = mx.softmax(scores, axis=-1).astype(q.dtype)
    out = mx.quantized_matmul(weights, *[a[:, :, None] for a in values], transpose=False, group_size=32, bits=4)
    return out.reshape(batch, heads, 1, head_dim)


def main() -> None:
    if sys.argv[1:2] == ["--patch"]:
        cache.channel_blocks_decoded = lambda keys, bits: decoded_fused(*keys)
        from mlxllama.cli import main as mlxllama

        sys.argv = ["mlxllama"] + sys.argv[2:]
        mlxllama()
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=8192)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--attention", action="store_true", help="time a layer's attention of one query")
    args = parser.parse_args()
    keys = mx.random.normal((1, 4, cache.grown_size(args.depth + 1), 64)).astype(mx.float16)
    stored = cache.channel_blocks(keys, 4)
    mx.eval(stored)
    view = cache.slot_range(stored, 0, cache.whole_blocks(args.depth))
    assert mx.array_equal(cache.channel_blocks_decoded(view, 4), decoded_fused(*view)).item()
    variants = (("shipped", lambda: cache.channel_blocks_decoded(view, 4)), ("fused", lambda: decoded_fused(*view)))
    what = "a layer's keys"
    if args.attention:
        n = cache.whole_blocks(args.depth)
        values = tuple(mx.quantize(mx.random.normal((1, 4, n, 64)).astype(mx.float16), 32, 4))
        q = mx.random.normal((1, 32, 1, 64)).astype(mx.float16)
        mx.eval(values, q)

        def shipped():
            return mx.fast.scaled_dot_product_attention(q, cache.channel_blocks_decoded(view, 4),
                                                        mx.dequantize(*values, group_size=32, bits=4), scale=0.125)

        difference = mx.abs(shipped().astype(mx.float32) - attention_by_block_products(q, view, values, 0.125)).max()
        print(f"largest difference of the two attentions' outputs: {difference.item():.2e}")
        variants = (("shipped", shipped),
                    ("block products", lambda: attention_by_block_products(q, view, values, 0.125)))
        what = "a layer's attention of one query"
    for name, decode in variants:
        for _ in range(5):
            mx.eval(decode())
        mx.synchronize()
        start = time.perf_counter()
        for _ in range(args.runs):
            mx.eval(decode())
        mx.synchronize()
        print(f"{name}: {(time.perf_counter() - start) / args.runs * 1e6:.1f} us {what} at depth {args.depth}"
              f" on {mx.default_device()}")


if __name__ == "__main__":
    main()
