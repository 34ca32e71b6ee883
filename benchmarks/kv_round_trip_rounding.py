"""How far a quantized cache lands from its round-trip reference, against how far quantizing moves
the output at all: the figures behind tests/unit/test_quantized_cache.py's assert_close on a GPU.

For each case of that test module (the fixtures, 8 and 4 bits, fed one token at a time or in
chunks, keys by channel, 8-bit keys beside 4-bit values, rotating caches), one JSON line: the
largest output (`scale`), the cache's difference from the one-pass round trip (`diff_*`) and the
unquantized pass's difference from it (`quant_*`); `unquantized ...` lines give float16's own
chunk-against-pass difference. On the CPU every diff is 0. It uses the test module's reference
pass, so it runs from the repository root:

    python benchmarks/kv_round_trip_rounding.py [--only "by_channel"] > round-trip-differences.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

sys.path[:0] = ["tests", "tests/unit"]

import mlx.core as mx  # noqa: E402

from test_quantized_cache import MODELS, TEXT, chunked, quantized, reference  # noqa: E402


def line(case: str, got: mx.array, want: mx.array, unquantized: mx.array) -> dict:
    difference, quantizing = mx.abs(got - want), mx.abs(unquantized - want)
    return {"case": case, "scale": float(mx.abs(want).max()), "diff_max": float(difference.max()),
            "diff_mean": float(difference.mean()), "quant_max": float(quantizing.max()),
            "quant_mean": float(quantizing.mean())}


def chunked_case(name: str, bits: int, chunk: int) -> dict:
    rt = quantized(name, bits)
    ids = rt.tokenize(TEXT)[: 90 if chunk == 1 else 300]
    return line(f"chunked {name} {bits} {chunk}", chunked(rt, ids, chunk, rt.model.make_cache()),
                reference(rt, ids, rt.model.kv_quantization), reference(rt, ids, None))


def by_channel_case(name: str) -> dict:
    rt = quantized(name, 4, keys_by_channel=True)
    ids = rt.tokenize(TEXT)[:256]
    return line(f"by_channel {name}", chunked(rt, ids, 64, rt.model.make_cache()),
                reference(rt, ids, rt.model.kv_quantization), reference(rt, ids, None))


def unquantized_case(name: str, chunk: int) -> dict:
    rt = quantized(name, 8)
    rt.model.store_kv_quantized(None)
    ids = rt.tokenize(TEXT)[: 90 if chunk == 1 else 300]
    want = reference(rt, ids, None)
    return line(f"unquantized {name} {chunk}", chunked(rt, ids, chunk, rt.model.make_cache()), want, want)


def keys8_case(name: str) -> dict:
    rt = quantized(name, 4, key_bits=8)
    ids = rt.tokenize(TEXT)[:300]
    return line(f"keys8 {name}", chunked(rt, ids, 37, rt.model.make_cache()),
                reference(rt, ids, rt.model.kv_quantization), reference(rt, ids, None))


def rotating_case(bits: int, by_channel: bool) -> dict:
    keep, max_size, chunk = (32, 160, 64) if by_channel else (4, 80, 29)
    rt = quantized("gemma3-tiny-Q8_0.gguf", bits, keys_by_channel=by_channel)
    ids = rt.tokenize(TEXT)[:500]
    got = chunked(rt, ids, chunk, rt.model.make_cache(max_kv_size=max_size, keep=keep))
    q, k = mx.arange(len(ids))[:, None], mx.arange(len(ids))[None, :]
    kept = (k <= q) & ((k < keep) | (k > q - (max_size - keep)))
    return line(f"rotating gemma3-tiny-Q8_0.gguf {bits} {by_channel}", got,
                reference(rt, ids, rt.model.kv_quantization, kept), reference(rt, ids, None, kept))


CASES = {**{f"chunked {n} {b} {c}": partial(chunked_case, n, b, c) for n in MODELS for b in (8, 4) for c in (1, 37)},
         **{f"by_channel {n}": partial(by_channel_case, n) for n in MODELS},
         **{f"unquantized {n} {c}": partial(unquantized_case, n, c) for n in MODELS for c in (1, 37)},
         **{f"keys8 {n}": partial(keys8_case, n) for n in ("chat-tiny-Q4_K_M.gguf", "qwen3-tiny-Q4_K_M.gguf")},
         **{f"rotating gemma3-tiny-Q8_0.gguf {b} {c}": partial(rotating_case, b, c) for b, c in ((8, False), (4, True))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="the cases whose name holds this text (default: all)")
    only = parser.parse_args().only
    for case, measure in CASES.items():
        if only in case:
            print(json.dumps(measure()), flush=True)


if __name__ == "__main__":
    main()
