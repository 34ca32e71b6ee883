"""The prompt cache: longest-prefix lookup, the last prompt token always fed, bounded by least recent use."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import mlxllama
from mlxllama.prompt_cache import PromptCache

from conftest import PACKAGE_DATA

# One layer of keys and values for 8 positions: 2 x 8 x 4 float32 = 128 bytes an entry of 4 positions.
LAYER = (mx.arange(64, dtype=mx.float32).reshape(1, 2, 8, 4), -mx.arange(64, dtype=mx.float32).reshape(1, 2, 8, 4))


def test_lookup_finds_the_longest_prefix_and_leaves_the_last_token_to_feed():
    cache = PromptCache(10_000)
    cache.store([1, 2, 3, 4], [LAYER])
    cache.store([1, 2, 9], [LAYER])
    assert cache.lookup([1, 2, 3, 4, 5])[1] == 4
    assert cache.lookup([1, 2, 3, 4])[1] == 3  # the whole prompt cached: its last token is fed again
    assert cache.lookup([1, 2, 9, 9])[1] == 3
    assert cache.lookup([7, 1, 2]) == (None, 0)
    entry, n = cache.lookup([1, 2, 3, 4, 5])
    np.testing.assert_array_equal(np.array(entry.layers[0][0]), np.array(LAYER[0][:, :, :4]))


def test_an_extension_replaces_its_prefix_and_the_least_recently_used_goes_first():
    cache = PromptCache(2 * 256)  # room for two entries of 4 positions (keys and values 128 bytes each)
    cache.store([1, 2], [LAYER])
    cache.store([1, 2, 3, 4], [LAYER])
    assert [e.ids for e in cache.entries] == [(1, 2, 3, 4)]
    cache.store([5, 6, 7, 8], [LAYER])
    cache.lookup([1, 2, 3, 4, 0])  # now the older entry is the more recently used
    cache.store([9, 9, 9, 9], [LAYER])
    assert sorted(e.ids for e in cache.entries) == [(1, 2, 3, 4), (9, 9, 9, 9)] and cache.nbytes <= 512


def test_a_restored_prefix_continues_exactly_as_a_fresh_prefill():
    runtime = mlxllama.load(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf")
    model, ids = runtime.model, runtime.tokenize("The capital of Italy is Rome. The capital of Japan is")
    fresh = model.make_cache()
    want = model(mx.array([ids]), fresh)[0, -1]
    store = PromptCache(1 << 30)
    store.store(ids[:6], [(c.keys, c.values) for c in fresh])
    entry, n = store.lookup(ids)
    restored = store.restore(entry, n, model)
    got = model(mx.array([ids[n:]]), restored)[0, -1]
    assert n == 6 and restored[0].offset == len(ids)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=1e-5)


def test_a_taken_cache_is_the_one_put_cut_to_the_shared_prefix_and_leaves_the_store():
    runtime = mlxllama.load(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf")
    model, ids = runtime.model, runtime.tokenize("The capital of Italy is Rome. The capital of Japan is")
    cache = model.make_cache()
    model(mx.array([ids]), cache)
    store = PromptCache(1 << 30)
    store.put(ids + [99], cache)  # the cache holds only `ids`: the id past its offset is not kept
    assert [e.ids for e in store.entries] == [tuple(ids)]
    other = ids[:6] + runtime.tokenize("Paris", add_bos=False)
    taken, n = store.take(other, model)
    assert n == 6 and store.entries == [] and store.nbytes == 0
    assert all(t.keys is c.keys and t.offset == 6 for t, c in zip(taken, cache))  # its buffers, not a copy
    fresh = model.make_cache()
    want = model(mx.array([other]), fresh)[0, -1]
    got = model(mx.array([other[n:]]), taken)[0, -1]
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=1e-5)
    assert store.take(other, model)[1] == 0
