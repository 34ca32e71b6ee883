"""The quantized KV cache (--kv-bits, --kv-group-size, --quantized-kv-start, --kv-keys-by-channel):
keys and values stored as MLX's affine quantization stores them and attended with its quantized
products.

The reference is one full pass whose keys and values are quantized and dequantized exactly as the
cache stores them, attended the ordinary way: the cache must equal it within float rounding, in
every kind of cache (full, sliding window, rotating, batch) and however the tokens are fed. How
much quantizing costs in perplexity is measured against the unquantized cache
(tests/cli/test_kv_cache_cli.py and docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Callable

import mlx.core as mx
import numpy as np
import pytest

import mlxllama
from mlxllama.batching import BatchDecoder, Request, batch_generate
from mlxllama.cache import (CHANNEL_BLOCK, BatchKVCache, KVCache, KVQuantization, RingKVCache, RotatingKVCache, SlidingKVCache, capacity,
                            causal_mask, kv_bytes_per_position, kv_nbytes, visible)
from mlxllama.errors import MlxLlamaError
from mlxllama.prompt_cache import PromptCache

from conftest import PACKAGE_DATA, REPO_FIXTURES

TEXT = "The capital of Japan is Tokyo. What is 17 plus 25? My name is Zoe. " * 30
MODELS = ["chat-tiny-Q4_K_M.gguf", "gemma3-tiny-Q8_0.gguf", "qwen3-tiny-Q4_K_M.gguf"]


@cache
def runtime(name: str):
    path = PACKAGE_DATA / name if name.startswith("chat-tiny") else REPO_FIXTURES / name
    return mlxllama.load(path)


def quantized(name: str, bits: int, start: int = 0, key_bits: int | None = None, keys_by_channel: bool = False):
    """The model of `name`, its caches quantized so (the setting is restored by the fixture below)."""
    rt = runtime(name)
    rt.model.store_kv_quantized(KVQuantization(bits, start=start, key_bits=key_bits, keys_by_channel=keys_by_channel))
    return rt


@pytest.fixture(autouse=True)
def unquantized_after():
    yield
    for name in MODELS:
        runtime(name).model.store_kv_quantized(None)


class RoundTripPass:
    """A layer "cache" for one full pass that keeps nothing and hands attention the keys and values
    as a quantized cache would read them back, under the mask it is given; after those of a
    `prefix` (an unquantized layer cache), if any."""

    def __init__(self, quantization: KVQuantization | None, mask, prefix=None):
        self.quantization, self._mask, self.prefix = quantization, mask, prefix
        self.offset = prefix.offset if prefix else 0

    def mask(self, length: int, window: int = 0):
        return self._mask if self._mask is not None else causal_mask(length, self.offset, window)

    def update_and_fetch(self, keys, values):
        if self.prefix is not None:
            held = self.prefix.offset
            keys = mx.concatenate([self.prefix.keys[..., :held, :], keys], axis=2)
            values = mx.concatenate([self.prefix.values[..., :held, :], values], axis=2)
        if self.quantization is None:
            return keys, values
        return self.quantization.decode(*self.quantization.encode(keys, values))


def reference(rt, ids: list[int], quantization: KVQuantization | None, mask=None, prefix=None) -> mx.array:
    """The last layer's output at every position from one pass whose keys and values went through
    `quantization` (after a `prefix` cache's, the same way)."""
    layers = [RoundTripPass(quantization, mask if mask is None or not block.window else None, prefix and prefix[i])
              for i, block in enumerate(rt.model.blk)]
    return rt.model.hidden_states(mx.array([ids]), layers)[0]


def chunked(rt, ids: list[int], chunk: int, kv) -> mx.array:
    """The last layer's output at every position, fed `chunk` ids at a time (the output layer,
    which attention does not touch, is left out: it is most of a tiny model's time)."""
    rows = []
    for start in range(0, len(ids), chunk):
        rows.append(rt.model.hidden_states(mx.array([ids[start : start + chunk]]), kv)[0])
        mx.eval(rows[-1])
    return mx.concatenate(rows)


def assert_close(got: mx.array, want: mx.array, unquantized: Callable[[], mx.array] | None = None) -> None:
    """Equal within rounding, relative to the largest output (chat-tiny's residual stream reaches
    5,500). On the CPU the same dequantized values go through other products (quantized ones, and
    chunks): float32 rounding, and in practice equal to the bit.

    float16 on a GPU rounds the keys of chunks and of one pass apart, and a key that rounds across
    the midpoint of two levels is stored one level apart: that moves the output by up to half of
    what quantizing moves it by at all. So a quantized cache is held, there, to its round trip by
    that: the difference at most the quantization's own (`unquantized`: the same pass without it),
    and on average at most 0.75 of it (measured on an H200: up to 0.51 of it fed one token at a
    time, below 0.2 fed in chunks; a cache that stored full precision differs by all of it)."""
    difference, scale = mx.abs(got - want), float(mx.abs(want).max())
    if mx.default_device() == mx.cpu:
        assert float(difference.max()) <= 1e-5 * scale
    elif unquantized is None:  # chunks and one pass round differently, quantized or not
        assert float(difference.max()) <= 2e-2 * scale and float(difference.mean()) <= 1e-3 * scale
    else:
        quantizing = mx.abs(unquantized() - want)
        assert float(difference.max()) <= float(quantizing.max())
        assert float(difference.mean()) <= 0.75 * float(quantizing.mean())


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("chunk", [1, 37])
def test_chunked_passes_equal_the_round_trip_pass(name, bits, chunk):
    rt = quantized(name, bits)
    ids = rt.tokenize(TEXT)[: 90 if chunk == 1 else 300]
    kv = rt.model.make_cache()
    got = chunked(rt, ids, chunk, kv)
    assert all(layer.quantized and layer.offset == len(ids) for layer in kv)
    want = reference(rt, ids, rt.model.kv_quantization)
    assert_close(got, want, lambda: reference(rt, ids, None))
    # and it is not the unquantized pass (by 1.3% of the largest output at the least, chat-tiny's
    # at 8 bits): the test would see a cache that stored full precision
    assert float(mx.abs(got - reference(rt, ids, None)).max()) > 5e-3 * float(mx.abs(want).max())


@pytest.mark.parametrize("name", ["chat-tiny-Q4_K_M.gguf", "qwen3-tiny-Q4_K_M.gguf"])
def test_keys_at_8_bits_beside_4_bit_values_equal_their_round_trip_pass(name):
    """--kv-bits 4 --kv-key-bits 8: each stored at its own width, attended as stored."""
    rt = quantized(name, 4, key_bits=8)
    ids = rt.tokenize(TEXT)[:300]
    kv = rt.model.make_cache()
    got = chunked(rt, ids, 37, kv)
    head_dim = rt.config.head_dim
    assert all(layer.keys[0].shape[-1] == head_dim * 8 // 32 and layer.values[0].shape[-1] == head_dim * 4 // 32
               for layer in kv)
    assert_close(got, reference(rt, ids, rt.model.kv_quantization), lambda: reference(rt, ids, None))
    # nearer the unquantized pass than with 4-bit keys (0.56 of their mean difference on qwen3-tiny's
    # random weights; trained models' keys carry outlier channels and gain more, docs/benchmarks.md)
    unquantized = reference(rt, ids, None)
    four = reference(rt, ids, KVQuantization(4, rt.model.kv_quantization.group_size))
    assert float(mx.abs(got - unquantized).mean()) < 0.75 * float(mx.abs(four - unquantized).mean())


@pytest.mark.parametrize("chunk", [1, 37])
def test_heads_of_two_groups_dequantized_as_on_cuda_equal_the_round_trip_pass(monkeypatch, chunk):
    """MLX's CUDA build has no quantized product for attention's shapes, so there every quantized
    cache is decoded and attended as an unquantized one: that route, taken here on the CPU by a
    model whose heads hold two groups (which the quantized products take on the CPU)."""
    from mlxllama.models import transformer

    rt = quantized("qwen3-tiny-Q4_K_M.gguf", 8)
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()  # where this route is the only one
    assert transformer.quantized_products_run(rt.config.head_dim, rt.model.kv_quantization) != on_cuda
    monkeypatch.setattr(transformer, "quantized_products_run", lambda *args: False)
    # not the explicit quantized products (whose float32 scores of a long prefill at depth would be
    # held at once); CUDA's prefill attends a plain cache by explicit products of its own
    explicit = transformer.explicit_attention

    def plain_only(q, k, *args):
        return pytest.fail("an explicit quantized product ran") if isinstance(k, tuple) else explicit(q, k, *args)

    monkeypatch.setattr(transformer, "explicit_attention", plain_only)
    ids = rt.tokenize(TEXT)[: 90 if chunk == 1 else 300]
    kv = rt.model.make_cache()
    got = chunked(rt, ids, chunk, kv)
    assert all(layer.quantized and layer.offset == len(ids) for layer in kv)
    assert_close(got, reference(rt, ids, rt.model.kv_quantization), lambda: reference(rt, ids, None))


def test_the_first_positions_stay_full_precision_until_the_start():
    rt = quantized("chat-tiny-Q4_K_M.gguf", 4, start=100)
    ids = rt.tokenize(TEXT)[:250]
    kv = rt.model.make_cache()
    before = chunked(rt, ids[:96], 32, kv)
    assert not kv[0].quantized and kv[0].offset == 96
    assert_close(before, reference(rt, ids[:96], None))
    # The keys and values of those 96 positions, computed at full precision throughout.
    rt.model.store_kv_quantized(None)
    prefix = rt.model.make_cache()
    chunked(rt, ids[:96], 96, prefix)
    # The chunk that takes the cache past the start sees every position quantized, the first ones too.
    after = chunked(rt, ids[96:], 32, kv)
    assert kv[0].quantized
    assert_close(after, reference(rt, ids[96:], kv[0].quantization, prefix=prefix),
                 lambda: reference(rt, ids[96:], None, prefix=prefix))


def test_rotating_cache_quantized_equals_the_masked_round_trip_pass():
    rt = quantized("gemma3-tiny-Q8_0.gguf", 8)
    ids = rt.tokenize(TEXT)[:500]
    max_size, keep = 80, 4
    kv = rt.model.make_cache(max_kv_size=max_size, keep=keep)
    got = chunked(rt, ids, 29, kv)
    assert any(isinstance(layer, RotatingKVCache) and layer.quantized for layer in kv)
    q, k = mx.arange(len(ids))[:, None], mx.arange(len(ids))[None, :]
    kept = (k <= q) & ((k < keep) | (k > q - (max_size - keep)))
    assert_close(got, reference(rt, ids, rt.model.kv_quantization, kept), lambda: reference(rt, ids, None, kept))


@pytest.mark.parametrize("bits, key_bits", [(8, None), (4, None), (4, 8)])
def test_memory_per_position_is_the_quantized_size(bits, key_bits):
    rt = quantized("chat-tiny-Q4_K_M.gguf", bits, key_bits=key_bits)
    ids = rt.tokenize(TEXT)[:300]
    kv = rt.model.make_cache()
    chunked(rt, ids, 100, kv)
    held = sum(kv_nbytes(layer.keys) + kv_nbytes(layer.values) for layer in kv)
    per_position = kv_bytes_per_position(rt.config, rt.model.compute_dtype, rt.model.kv_quantization)
    assert held == capacity(kv[0].keys) * per_position
    # bits a value, and a scale and a bias of the compute type every 32 (chat-tiny's heads are 32 wide)
    full = kv_bytes_per_position(rt.config, rt.model.compute_dtype)
    mean_bits = (bits + (key_bits or bits)) / 2
    assert per_position / full == pytest.approx((mean_bits / 8 + 2 * rt.model.compute_dtype.size / 32)
                                                / rt.model.compute_dtype.size)


def greedy(rt, prompts: list[list[int]], max_tokens: int, batch_size: int) -> list[list[int]]:
    results = batch_generate(rt, prompts, max_tokens=max_tokens, batch_size=batch_size, temperature=0.0)
    return [r.token_ids for r in results]


@pytest.mark.parametrize("start", [0, 20])
@pytest.mark.parametrize("bits, by_channel", [(8, False), (4, True)])
def test_batched_rows_decode_as_each_alone(start, bits, by_channel):
    """Rows of different lengths in one quantized batch cache (rows joining before and after it
    passes the start) give each row's ids alone; logits equal within float rounding, so ids equal
    where the top two are not within a near-tie margin."""
    rt = quantized("chat-tiny-Q4_K_M.gguf", bits, start=start, keys_by_channel=by_channel)
    prompts = [rt.tokenize(t) for t in ("The capital of Italy is", "Once upon a time there was a",
                                        "1, 2, 3, 4,", "The quick brown fox jumps over the lazy dog")]
    alone = [greedy(rt, [p], 24, 1)[0] for p in prompts]
    together = greedy(rt, prompts, 24, 3)
    assert together == alone


@pytest.mark.parametrize("by_channel", [False, True])
def test_quantized_rows_go_through_the_prompt_store(by_channel):
    """Finished rows are stored quantized and a later prompt starting the same way restores them."""
    rt = quantized("chat-tiny-Q4_K_M.gguf", 4, keys_by_channel=by_channel)
    store = PromptCache(1 << 24)
    decoder = BatchDecoder(rt.model, rt.tokenizer, 4, prompt_cache=store)
    prompt = rt.tokenize("The capital of Italy is Rome. The capital of Japan is")
    first = greedy(rt, [prompt], 8, 1)[0]
    for _ in range(2):
        row = decoder.admit(0, Request(prompt, max_tokens=8))
        while decoder.joining:
            decoder.prefill_chunk()
        while decoder.rows:
            decoder.step()
        assert row.ids == first
    assert row.cached_tokens == len(prompt) - 1
    assert all(isinstance(keys, tuple) for keys, _ in store.entries[0].layers)
    assert bool(store.entries[0].copies) == by_channel  # the row's copies of its last block's keys went too


def test_settings_mlx_cannot_quantize_with_are_one_line_errors():
    model = runtime("chat-tiny-Q4_K_M.gguf").model
    with pytest.raises(MlxLlamaError, match="--kv-bits must be 4 or 8, not 3"):
        model.store_kv_quantized(KVQuantization(3))
    with pytest.raises(MlxLlamaError, match="--kv-group-size 64 does not divide the model's head size 32"):
        model.store_kv_quantized(KVQuantization(8, 64))
    with pytest.raises(MlxLlamaError, match="--kv-group-size must be 32, 64 or 128, not 16"):
        model.store_kv_quantized(KVQuantization(8, 16))
    model.store_kv_quantized(KVQuantization(8))
    assert model.kv_quantization.group_size == 32  # 64 does not divide chat-tiny's heads of 32
    assert runtime("qwen3-tiny-Q4_K_M.gguf").model.config.head_dim % 64 == 0
    qwen3 = quantized("qwen3-tiny-Q4_K_M.gguf", 4).model
    assert qwen3.kv_quantization.group_size == 64


def test_quantized_attention_matches_the_dequantized_product():
    """The attention itself, without a model: GQA heads, a ragged boolean mask, both bit widths and keys
    wider than values; heads of two groups, so that MLX's quantized products run (not dequantized)."""
    from mlxllama.models.transformer import explicit_attention, quantized_products_run

    if not quantized_products_run(128, KVQuantization(8, 64)):
        pytest.skip("MLX's CUDA build has no quantized product for attention's shapes")
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.normal(size=shape).astype(np.float32)) for shape in
               ((2, 6, 5, 128), (2, 2, 40, 128), (2, 2, 40, 128)))
    mask = visible(mx.array([[30], [7]])[:, :, None] + mx.arange(5)[None, :, None], mx.arange(40)[None, None, :], 0)[:, None]
    for bits, key_bits in ((8, None), (4, None), (4, 8)):
        quantization = KVQuantization(bits, 64, key_bits=key_bits)
        stored_k, stored_v = quantization.encode(k, v)
        back_k, back_v = quantization.decode(stored_k, stored_v)
        assert float(mx.abs(back_k - k).max()) < (0.1 if (key_bits or bits) == 8 else 0.5)
        got = explicit_attention(q, stored_k, stored_v, 0.125, mask, quantization)
        want = explicit_attention(q, back_k, back_v, 0.125, mask)
        assert float(mx.abs(got - want).max()) < 1e-5


BY_CHANNEL = KVQuantization(4, 32, keys_by_channel=True)


def random_heads(rng, positions: int, head_dim: int = 64) -> mx.array:
    """Keys or values [1, 2, positions, head_dim], two of whose channels are 20 times the others, as
    trained models' keys have outlying channels."""
    scale = np.ones(head_dim, np.float32)
    scale[[3, 40]] = 20
    return mx.array(rng.normal(size=(1, 2, positions, head_dim)).astype(np.float32) * scale)


def by_channel_round_trip(keys: mx.array) -> mx.array:
    """keys as stored by channel in one go, from position 0 (whole blocks, the last filled out)."""
    return BY_CHANNEL.decode(*BY_CHANNEL.encode(keys, keys))[0]


def test_keys_by_channel_fed_in_any_pieces_equal_the_blocks_quantized_at_once():
    """Each write stores the last block again, from the full-precision copies of its keys: however
    the positions come, the cache holds what quantizing them all at once gives. Values are stored
    along the head as ever."""
    rng = np.random.default_rng(0)
    keys, values = random_heads(rng, 200), random_heads(rng, 200)
    cache, fed = KVCache(BY_CHANNEL), 0
    for piece in (1, 5, 40, 1, 1, 30, 32, 64, 26):
        got_k, got_v = cache.update_and_fetch(keys[:, :, fed : fed + piece], values[:, :, fed : fed + piece])
        fed += piece
        got_keys, got_values = BY_CHANNEL.decode(got_k, got_v)
        assert cache.offset == fed and got_keys.shape[2] == got_values.shape[2] == fed
        assert mx.array_equal(got_keys, by_channel_round_trip(keys[:, :, :fed]))
        assert mx.array_equal(got_values, BY_CHANNEL.decode(*BY_CHANNEL.encode(keys, values[:, :, :fed]))[1])
    # a key's scales and biases a channel of a block: where groups of 32 along the head put theirs
    along_head = KVQuantization(4, 32).encode(keys, values)[0]
    assert [a.shape[-1] for a in cache.keys] == [a.shape[-1] for a in along_head]
    # grouped along the head, an outlying channel sets the step of its group's other codes
    along_head = KVQuantization(4, 32).decode(*KVQuantization(4, 32).encode(keys, values))[0]
    others = mx.array(np.delete(np.arange(64), [3, 40]))
    head_error = float(mx.abs(along_head - keys)[..., others].mean())
    assert float(mx.abs(by_channel_round_trip(keys) - keys)[..., others].mean()) < 0.3 * head_error  # 0.22


def test_keys_by_channel_trimmed_within_two_blocks_continue_exactly_and_past_them_keep_earlier_blocks():
    """The cache keeps full-precision copies of its last full block and the one it fills: trimmed
    back into either (speculative decoding's rejected drafts), it stores the blocks again exactly
    as if the trimmed positions had never come."""
    rng = np.random.default_rng(1)
    keys = random_heads(rng, 200)
    cache = KVCache(BY_CHANNEL)
    cache.update_and_fetch(keys[:, :, :90], keys[:, :, :90])
    cache.trim(5)  # 85: in the block of 64 .. 95
    cache.update_and_fetch(keys[:, :, 85:100], keys[:, :, 85:100])
    cache.trim(30)  # 70: back across a block's end, into the full block before
    got, _ = BY_CHANNEL.decode(*cache.update_and_fetch(keys[:, :, 70:130], keys[:, :, 70:130]))
    assert mx.array_equal(got, by_channel_round_trip(keys[:, :, :130]))
    before = BY_CHANNEL.decode(*cache.fetched(130))[0]
    cache.trim(60)  # 70 again: 64 .. 95 is two blocks back now, filled again from its stored keys
    got, _ = BY_CHANNEL.decode(*cache.update_and_fetch(keys[:, :, 70:200], keys[:, :, 70:200]))
    assert mx.array_equal(got[:, :, :64], before[:, :, :64])
    step = float(mx.abs(keys[:, :, 64:96]).max()) * 2 / 15  # a code's step in the widest channel
    assert float(mx.abs(got[:, :, 64:] - by_channel_round_trip(keys)[:, :, 64:]).max()) <= step
    assert not mx.array_equal(got[:, :, 64:96], by_channel_round_trip(keys)[:, :, 64:96])


@pytest.mark.parametrize("kind", [KVCache, lambda q: RotatingKVCache(64, 32, q)])
def test_the_prompt_store_gives_keys_by_channel_back_with_their_copies(kind):
    """A chat puts its cache in the store between turns and takes it back: the copies of the last
    blocks' keys go and come back with it, so the next turn stores its blocks as if the cache had
    never left (a rotating cache's restore too)."""

    class Model:
        def make_cache(self, max_kv_size=0, keep=0):
            return [kind(BY_CHANNEL)]

    rng = np.random.default_rng(4)
    keys = random_heads(rng, 200)
    first = kind(BY_CHANNEL)
    first.update_and_fetch(keys[:, :, :90], keys[:, :, :90])
    went = first.copies
    store, ids = PromptCache(1 << 24), list(range(200))
    store.put(ids[:90], [first])
    (back,), held = store.take(ids[:91], Model())
    assert held == 90 and back.copies[1] == went[1] and mx.array_equal(back.copies[0], went[0])
    alone = kind(BY_CHANNEL)
    want = BY_CHANNEL.decode(*alone.update_and_fetch(keys[:, :, :130], keys[:, :, :130]))[0]
    got = BY_CHANNEL.decode(*back.update_and_fetch(keys[:, :, 90:130], keys[:, :, 90:130]))[0]
    assert mx.array_equal(got, want)


def test_a_sliding_window_keeps_whole_blocks_of_keys_by_channel():
    """A sliding layer's cache moves what it keeps to its front a whole number of blocks at a time,
    so that its keys by channel stay the blocks of their positions."""
    rng = np.random.default_rng(2)
    keys = random_heads(rng, 700)
    cache, fed = SlidingKVCache(50, BY_CHANNEL), 0
    for piece in (33, 1, 300, 1, 1, 250, 114):
        got_k, got_v = cache.update_and_fetch(keys[:, :, fed : fed + piece], keys[:, :, fed : fed + piece])
        fed += piece
        got = BY_CHANNEL.decode(got_k, got_v)[0]
        assert cache.start % CHANNEL_BLOCK == 0 and cache.start <= max(0, fed - piece - 49)
        assert mx.array_equal(got, by_channel_round_trip(keys[:, :, :fed])[:, :, cache.start :])
    assert cache.start > 0


@pytest.mark.parametrize("keep", [0, 32])
def test_a_rotating_cache_keeps_whole_blocks_of_keys_by_channel(keep):
    """The first `keep` positions (whole blocks) stay where they are; the window behind them drops
    whole blocks, so its keys stay the blocks of their positions."""
    rng = np.random.default_rng(3)
    keys = random_heads(rng, 900)
    cache, fed = RotatingKVCache(120, keep, BY_CHANNEL), 0
    for piece in (33, 1, 300, 1, 1, 250, 114, 200):
        got_k, got_v = cache.update_and_fetch(keys[:, :, fed : fed + piece], keys[:, :, fed : fed + piece])
        fed += piece
        got, once = BY_CHANNEL.decode(got_k, got_v)[0], by_channel_round_trip(keys[:, :, :fed])
        positions, slots = cache.held()
        assert cache.start % CHANNEL_BLOCK == 0 and got.shape[2] == slots[-1] + 1
        assert mx.array_equal(got[:, :, mx.array(slots)], once[:, :, mx.array(positions)])
    assert cache.start > keep + 400


def test_a_rotating_cache_with_keys_by_channel_equals_the_masked_round_trip_pass():
    rt = quantized("gemma3-tiny-Q8_0.gguf", 4, keys_by_channel=True)
    ids = rt.tokenize(TEXT)[:512]
    max_size, keep = 160, 32
    kv = rt.model.make_cache(max_kv_size=max_size, keep=keep)
    got = chunked(rt, ids, CHANNEL_BLOCK * 2, kv)
    assert any(isinstance(layer, RotatingKVCache) and layer.keys_by_channel and layer.start > keep for layer in kv)
    q, k = mx.arange(len(ids))[:, None], mx.arange(len(ids))[None, :]
    kept = (k <= q) & ((k < keep) | (k > q - (max_size - keep)))
    assert_close(got, reference(rt, ids, rt.model.kv_quantization, kept), lambda: reference(rt, ids, None, kept))


@pytest.mark.parametrize("name", MODELS)
def test_keys_by_channel_fed_a_block_at_a_time_equal_the_round_trip_pass(name):
    """Fed whole blocks, a query sees its block as quantized whole, as the one-pass reference does
    (fed fewer, it sees its block's keys so far, quantized as they stand)."""
    rt = quantized(name, 4, keys_by_channel=True)
    ids = rt.tokenize(TEXT)[:256]
    kv = rt.model.make_cache()
    got = chunked(rt, ids, CHANNEL_BLOCK * 2, kv)
    assert all(layer.keys_by_channel and layer.offset == len(ids) for layer in kv)
    want = reference(rt, ids, rt.model.kv_quantization)
    assert_close(got, want, lambda: reference(rt, ids, None))
    along_head = reference(rt, ids, KVQuantization(4, rt.model.kv_quantization.group_size))
    assert float(mx.abs(got - along_head).max()) > 5e-3 * float(mx.abs(want).max())


def test_keys_by_channel_take_the_memory_of_groups_of_32_along_the_head():
    rt = quantized("qwen3-tiny-Q4_K_M.gguf", 4, keys_by_channel=True)
    kv = rt.model.make_cache()
    chunked(rt, rt.tokenize(TEXT)[:300], 100, kv)
    held = sum(kv_nbytes(layer.keys) + kv_nbytes(layer.values) for layer in kv)
    per_position = kv_bytes_per_position(rt.config, rt.model.compute_dtype, rt.model.kv_quantization)
    assert held == capacity(kv[0].keys) * per_position
    size = rt.model.compute_dtype.size  # keys: a scale and bias every 32; values: every 64 (heads of 128)
    full = kv_bytes_per_position(rt.config, rt.model.compute_dtype)
    assert per_position / full == pytest.approx((0.5 + (2 * size / 32 + 2 * size / 64) / 2) / size)


@pytest.mark.parametrize("make", ["make_cache", "make_batch_cache"])
def test_keys_by_channel_bounded_need_whole_blocks_kept(make):
    rt = quantized("chat-tiny-Q4_K_M.gguf", 4, keys_by_channel=True)
    with pytest.raises(MlxLlamaError, match=r"^--kv-keys-by-channel with --max-kv-size needs --keep to be a multiple"
                                            r" of 32 \(0, 32, 64...\), not 4$"):
        getattr(rt.model, make)(max_kv_size=64, keep=4)


def batch_rows(keys: list[mx.array], fed: list[int], width: int | list[int]) -> mx.array:
    """Row i's next `width` keys (each row its own width, the rest of the widest padded with keys
    20 times larger, which must not count), stacked as a batch cache's update takes them."""
    widths = [width] * len(keys) if isinstance(width, int) else width
    widest = max(widths)
    rows = []
    for k, f, w in zip(keys, fed, widths):
        pad = 20 * mx.ones((1, k.shape[1], widest - w, k.shape[3]))
        rows.append(mx.concatenate([k[:, :, f : f + w], pad], axis=2))
    return mx.concatenate(rows)


def assert_rows_hold_their_blocks(batch: BatchKVCache, keys: list[mx.array]) -> None:
    """Each row's keys, as the batch cache stores them, are the blocks of its positions quantized at
    once, to the bit; its values its own, along the head."""
    stored_keys, stored_values = BY_CHANNEL.decode(*batch.fetched(max(batch.lengths)))
    for i, (k, n) in enumerate(zip(keys, batch.lengths)):
        if n:
            assert mx.array_equal(stored_keys[i : i + 1, :, :n], by_channel_round_trip(k[:, :, :n]))
            values = BY_CHANNEL.decode(*BY_CHANNEL.encode(k, k[:, :, :n]))[1]
            assert mx.array_equal(stored_values[i : i + 1, :, :n], values)


def test_rows_of_keys_by_channel_store_each_rows_blocks_as_alone():
    """A batch cache's rows, each of its own length, fed a token a step across their blocks' ends,
    and padded runs cut back to each row's own (a grouped prefill's rests; rows with fewer drafts),
    hold the blocks of their own keys quantized at once, as a single sequence's cache does; a row
    that leaves the others keeps its blocks, and one taken out as a single sequence's cache (and
    back through the prompt store) goes on storing them the same."""
    rng = np.random.default_rng(5)
    lengths = [0, 31, 32, 70, 95]
    keys = [random_heads(rng, 400) for _ in lengths]
    singles = [KVCache(BY_CHANNEL) for _ in lengths]
    for single, k, n in zip(singles, keys, lengths):
        if n:
            single.update_and_fetch(k[:, :, :n], k[:, :, :n])
    batch = BatchKVCache(BY_CHANNEL)
    batch.extend(singles)
    assert_rows_hold_their_blocks(batch, keys)
    for _ in range(40):
        new = batch_rows(keys, batch.lengths, 1)
        batch.update_and_fetch(new, new)
        assert_rows_hold_their_blocks(batch, keys)
    for widths in ([5, 40, 1, 33, 12], [1, 3, 2, 1, 3]):
        real = [n + w for n, w in zip(batch.lengths, widths)]
        batch.padded(real)
        new = batch_rows(keys, batch.lengths, widths)
        batch.update_and_fetch(new, new)
        batch.cut_rows(real)
        assert_rows_hold_their_blocks(batch, keys)
    batch.keep_rows([0, 2, 4])
    keys = [keys[0], keys[2], keys[4]]
    new = batch_rows(keys, batch.lengths, 1)
    batch.update_and_fetch(new, new)
    assert_rows_hold_their_blocks(batch, keys)

    class Model:
        def make_cache(self, bounded=True, max_kv_size=0, keep=0):
            return [KVCache(BY_CHANNEL)]

    n = batch.lengths[1]
    assert n % CHANNEL_BLOCK
    store, ids = PromptCache(1 << 24), list(range(n))
    store.store(ids, [batch.row(1)], copies=[batch.row_copies(1)])
    (restored,) = store.restore(store.entries[0], n, Model())
    for continued in (batch.single(1), restored):
        got = BY_CHANNEL.decode(*continued.update_and_fetch(keys[1][:, :, n : n + 50], keys[1][:, :, n : n + 50]))[0]
        assert mx.array_equal(got, by_channel_round_trip(keys[1][:, :, : n + 50]))


def test_rows_of_keys_by_channel_start_storing_them_together_and_take_joiners_of_either_kind():
    """With --quantized-kv-start, rows held at full precision are stored by channel once the longest
    passes the start, each from its own positions; a row at full precision joining quantized rows,
    and a quantized row joining rows at full precision, are stored so too."""
    later = replace(BY_CHANNEL, start=50)
    rng = np.random.default_rng(6)
    keys = [random_heads(rng, 200) for _ in range(4)]
    lengths = [10, 40, 20, 60]
    singles = [KVCache(later) for _ in lengths]
    for single, k, n in zip(singles, keys, lengths):
        single.update_and_fetch(k[:, :, :n], k[:, :, :n])
    assert [single.quantized for single in singles] == [False, False, False, True]
    batch = BatchKVCache(later)
    batch.extend(singles[:2])
    while not batch.quantized:
        new = batch_rows(keys[:2], batch.lengths, 1)
        batch.update_and_fetch(new, new)
    assert batch.lengths == [21, 51]
    batch.extend(singles[2:3])
    for _ in range(45):
        new = batch_rows(keys[:3], batch.lengths, 1)
        batch.update_and_fetch(new, new)
        assert_rows_hold_their_blocks(batch, keys[:3])
    held_apart = BatchKVCache(later)
    held_apart.extend([singles[0], singles[3]])
    assert held_apart.quantized
    for _ in range(40):
        new = batch_rows([keys[0], keys[3]], held_apart.lengths, 1)
        held_apart.update_and_fetch(new, new)
        assert_rows_hold_their_blocks(held_apart, [keys[0], keys[3]])


def test_a_ring_of_rows_keeps_whole_blocks_of_keys_by_channel():
    """Rows joining a ring batch cache (--max-kv-size in batch and serve) from rotating caches,
    some past their bound, fed a token a step past the ring's wrap and runs of up to spare + 1
    (drafts, padded and cut back): every position a later query sees holds the blocks of its row's
    keys quantized at once; the block a row fills never overwrites a position still seen."""
    rng = np.random.default_rng(7)
    max_size, keep, spare = 100, 32, 3
    lengths = [10, 64, 150, 300]
    keys = [random_heads(rng, 700) for _ in lengths]
    ring = RingKVCache(max_size, keep, BY_CHANNEL, spare)
    assert ring.ring == 128  # the window of 68 and 3 spare slots in whole blocks (96), and a block more
    for k, n in zip(keys, lengths):
        single = RotatingKVCache(max_size, keep, BY_CHANNEL)
        single.update_and_fetch(k[:, :, :n], k[:, :, :n])
        ring.add(single)

    def assert_seen_positions_hold_their_blocks():
        stored = BY_CHANNEL.decode(*ring.fetched(0))[0]
        for i, (k, n) in enumerate(zip(keys, ring.lengths)):
            seen = np.concatenate([np.arange(min(keep, n)), np.arange(max(keep, n - (max_size - keep) + 1), n)])
            slots = mx.array(ring._slot(seen))
            assert mx.array_equal(stored[i : i + 1, :, slots], by_channel_round_trip(k[:, :, :n])[:, :, mx.array(seen)])

    assert_seen_positions_hold_their_blocks()
    for step in range(120):
        if step % 3:
            new = batch_rows(keys, ring.lengths, 1)
            ring.update_and_fetch(new, new)
        else:
            widths = [1 + (step + i) % (spare + 1) for i in range(len(keys))]
            real = [n + w for n, w in zip(ring.lengths, widths)]
            ring.padded(real)
            new = batch_rows(keys, ring.lengths, widths)
            ring.update_and_fetch(new, new)
            kept = [n - (step + i) % 2 * (w > 1) for i, (n, w) in enumerate(zip(real, widths))]
            ring.cut_rows(kept)
            if kept != real:  # a rejected draft's key counts in its block until the row's next write, as alone
                continue
        assert_seen_positions_hold_their_blocks()
    assert min(ring.lengths) > keep + ring.ring and ring.keys[0].shape[2] == keep + ring.ring  # past the wrap, never grown


def test_a_ring_batch_with_keys_by_channel_decodes_each_row_as_alone():
    rt = quantized("chat-tiny-Q4_K_M.gguf", 4, keys_by_channel=True)
    prompts = [rt.tokenize(t) for t in ("The capital of Italy is", "Once upon a time there was a", TEXT[:400])]
    alone = [rt.generate(p, 60, temperature=0.0, max_kv_size=96, keep=32).token_ids for p in prompts]
    together = batch_generate(rt, prompts, max_tokens=60, batch_size=3, temperature=0.0, max_kv_size=96, keep=32)
    assert [r.token_ids for r in together] == alone
    assert len(prompts[2]) + 60 > 96 + 32  # that row ran past its bound


@pytest.mark.parametrize("by_channel", [False, True])
def test_the_servers_budget_counts_the_slots_a_ring_row_holds(by_channel):
    """--max-kv-size 128 --keep 32 with room for 2 drafts: 130 slots a row, or with keys by channel
    the window and drafts in whole blocks and a block more (192); the server's budget counts what
    a row's ring holds."""
    from mlxllama.server.engine import Engine

    rt = quantized("chat-tiny-Q4_K_M.gguf", 4, keys_by_channel=by_channel)
    engine = Engine(rt, max_kv_size=128, keep=32, draft_room=2)
    decoder = engine.decoder
    decoder.admit(0, Request(rt.tokenize("The capital of Italy is"), max_tokens=4))
    while decoder.joining:
        decoder.prefill_chunk()
    assert decoder.cache[0].slot_count == (192 if by_channel else 130)
    assert sum(kv_nbytes(layer.keys) + kv_nbytes(layer.values) for layer in decoder.cache) == engine.budget.bytes(1, 0)
