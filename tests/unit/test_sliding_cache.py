"""Gemma 3's sliding-window layers: a cache that keeps only the window gives the logits of one that
keeps everything, its memory stays bounded, and batching and the prompt cache work with it."""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

import mlxllama
from mlxllama.cache import GROWTH_STEP, KVCache, SlidingKVCache
from mlxllama.prompt_cache import PromptCache
from mlxllama.runtime import on_cuda

from conftest import find_fixture_model

WINDOW = 32  # the fixture's (scripts/make_arch_fixtures.py)


@lru_cache(maxsize=1)
def gemma3():
    # float32 on any device: the bars compare caches of different shapes, not float16 roundings
    return mlxllama.load(find_fixture_model("gemma3-tiny-Q8_0.gguf"), context_length=4096, dtype=mx.float32)


def ids(n: int) -> list[int]:
    return [(7 * i + 3) % 2900 + 10 for i in range(n)]


def test_a_window_cache_gives_the_logits_of_a_full_one_fed_in_any_chunks():
    model, sequence = gemma3().model, ids(700)
    bounded, full = model.make_cache(), model.make_cache(bounded=False)
    assert [type(c) for c in bounded] == [SlidingKVCache] * 5 + [KVCache] and all(type(c) is KVCache for c in full)
    fed = 0
    for chunk in (1, 5, 40, 300, 1, 1, 33, 31, 288):  # across several rebuilds of the buffer
        tokens = mx.array([sequence[fed : fed + chunk]])
        a, b = model(tokens, bounded), model(tokens, full)
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=0, atol=1e-4)
        fed += chunk
        # Positions and lengths advance by exactly the tokens fed, in every layer.
        assert all(c.offset == fed for c in bounded + full)
    sliding = [c for c in bounded if isinstance(c, SlidingKVCache)]
    # What a sliding layer holds: the window, the last call's tokens and a growth step of room.
    assert all(c.keys.shape[2] <= WINDOW - 1 + 300 + GROWTH_STEP and c.start > 0 for c in sliding)
    assert all(c.keys.shape[2] >= fed for c in full if isinstance(c, KVCache))


def test_a_long_generation_keeps_the_sliding_layers_memory_bounded():
    runtime = gemma3()
    cache = runtime.model.make_cache()
    for start in range(0, 3000, 500):
        runtime.model(mx.array([ids(3000)[start : start + 500]]), cache)
    slots = [c.keys.shape[2] for c in cache]
    assert max(slots[:5]) <= WINDOW - 1 + 500 + GROWTH_STEP < slots[5] and slots[5] >= 3000


def test_batched_greedy_ids_equal_single_generation():
    runtime = gemma3()
    prompts = [ids(n)[::-1] for n in (20, 45, 90)]  # shorter and longer than the window
    batched = mlxllama.batch_generate(runtime, prompts, max_tokens=24, batch_size=3)
    for prompt, result in zip(prompts, batched):
        assert result.token_ids == runtime.generate(prompt, 24).token_ids


def test_the_prompt_cache_restores_a_window_cache_only_where_it_holds_what_a_query_needs():
    model, sequence = gemma3().model, ids(700)
    cache = model.make_cache()
    for chunk in (sequence[:300], sequence[300:600], sequence[600:]):  # the second call moves the window
        model(mx.array([chunk]), cache)
    start = cache[0].start
    assert start == 300 - (WINDOW - 1) and cache[0].holds(700) and not cache[0].holds(start)
    store = PromptCache(1 << 30)
    store.put(sequence, cache)
    # A prompt sharing all 700 tokens continues from them; one sharing fewer than start + 31 cannot.
    assert store.lookup(sequence + [5], bounded=True)[1] == 700
    assert store.lookup(sequence[: start + 10] + [5], bounded=True) == (None, 0)
    assert store.lookup(sequence + [5], bounded=False) == (None, 0)  # a batch row needs every position
    taken, n = store.take(sequence + [5, 6], model)
    fresh = model.make_cache(bounded=False)
    want = model(mx.array([sequence + [5, 6]]), fresh)[0, -1]
    got = model(mx.array([[5, 6]]), taken)[0, -1]
    # One pass of 702 tokens against chunks of 300, 300, 100 and 2: on MLX's CUDA backend, even in
    # float32 with TF32 off, these differ by up to 0.023 (an H100; which attention path rounds so is
    # not located); a restore missing positions moves them by whole units.
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=5e-2 if on_cuda() else 1e-4)


def test_a_wide_window_takes_prefill_chunks_longer_than_the_room_left():
    """A window wider than a prefill chunk and the room a buffer keeps (Gemma 3 4B's 1,024 against
    chunks of 512): the second chunk finds the first slot still in the window, and the buffer grows."""
    cache = SlidingKVCache(1024)
    keys = mx.array(np.arange(3 * 512 * 4, dtype=np.float32).reshape(1, 1, 3 * 512, 4))
    for first in range(0, 3 * 512, 512):
        got, _ = cache.update_and_fetch(keys[:, :, first : first + 512], keys[:, :, first : first + 512])
    assert cache.offset == 3 * 512 and cache.start == 1  # the third chunk's first query, 1,024, sees 1 on
    assert mx.array_equal(got, keys[:, :, cache.start :])
