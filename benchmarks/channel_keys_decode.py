"""What decoding keys stored by channel (--kv-keys-by-channel) costs a layer, and one alternative.

Attention decodes such keys before its products (cache.channel_blocks_decoded: mx.dequantize over
the buffer's blocks turned [head_dim, positions], then turned back). The alternative, `fused`,
unpacks the codes itself in one compiled function whose last operation writes the keys in
position order, so that no copy follows. Both give the same keys to the bit (checked here).
Times one layer's keys of the TinyLlama shape (4 KV heads of 64) at a depth, in float16:

    python benchmarks/channel_keys_decode.py [--depth 8192] [--runs 200]

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
    args = parser.parse_args()
    keys = mx.random.normal((1, 4, cache.grown_size(args.depth + 1), 64)).astype(mx.float16)
    stored = cache.channel_blocks(keys, 4)
    mx.eval(stored)
    view = cache.slot_range(stored, 0, cache.whole_blocks(args.depth))
    assert mx.array_equal(cache.channel_blocks_decoded(view, 4), decoded_fused(*view)).item()
    for name, decode in (("shipped", lambda: cache.channel_blocks_decoded(view, 4)), ("fused", lambda: decoded_fused(*view))):
        for _ in range(5):
            mx.eval(decode())
        mx.synchronize()
        start = time.perf_counter()
        for _ in range(args.runs):
            mx.eval(decode())
        mx.synchronize()
        print(f"{name}: {(time.perf_counter() - start) / args.runs * 1e6:.1f} us a layer's keys at depth {args.depth}"
              f" on {mx.default_device()}")


if __name__ == "__main__":
    main()
