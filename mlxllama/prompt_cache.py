"""A store of KV caches keyed by the token ids they hold: a request whose prompt starts with ids
seen before (the earlier turns of a chat, a shared system prompt) reuses their keys and values and
prefills only the rest.

Bounded in bytes; the least recently used entry goes first. The server stores copies of finished
rows (contiguous, exactly their positions, never a view that would keep the batch's buffer alive)
and restores from them without taking them out. A chat session puts its own cache in between
turns and takes it out for the next one, buffers and all, so a turn copies nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count
from typing import Sequence

import mlx.core as mx

from .cache import Buffer, KVCache, block_start, keeps_window, kv_map, kv_nbytes, slot_range, whole_blocks


@dataclass
class Entry:
    ids: tuple[int, ...]
    # keys, values [1, kv_heads, slots, head_dim] a layer (quantized or not, as the cache stored
    # them), slot 0 holding position starts[i] (0 but for a sliding-window layer's cache, which
    # keeps only its window); later slots are unused
    layers: list[tuple[Buffer, Buffer]]
    nbytes: int
    used: int = field(default=0)
    starts: tuple[int, ...] = ()
    windows: tuple[int, ...] = ()
    # a cache put here as it was: each layer's KVCache.copies (keys by channel), given back on take
    copies: tuple[tuple, ...] = ()

    def holds(self, length: int, bounded: bool) -> bool:
        """Whether its first `length` positions can be restored into a cache (bounded: sliding
        layers keep their window only) with everything a later query needs."""
        return all(keeps_window(start, window if bounded else 0, length)
                   for start, window in zip(self.starts, self.windows))


class PromptCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: list[Entry] = []
        self._clock = count(1)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def lookup(self, ids: Sequence[int], bounded: bool = False) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `ids` that it can restore (see Entry.holds),
        and that prefix's length, at most len(ids) - 1 (the last prompt token is always fed, for
        the logits of the reply)."""
        best, length = None, 0
        for entry in self.entries:
            n = common_prefix(entry.ids, ids, len(ids) - 1)
            if n > length and entry.holds(n, bounded):
                best, length = entry, n
        if best is not None:
            best.used = next(self._clock)
        return best, length

    def restore(self, entry: Entry, length: int, model, bounded: bool = False, max_kv_size: int = 0,
                keep: int = 0) -> list[KVCache]:
        """A fresh cache (model.make_cache's, of these bounds) holding the entry's first `length`
        positions (the entry is left as it is)."""
        cache = model.make_cache(bounded, max_kv_size, keep)
        _fill(cache, entry, length, lambda a, end: slot_range(a, 0, end))
        return cache

    def store(self, ids: Sequence[int], layers: Sequence[tuple[Buffer, Buffer]], copy: bool = True,
              copies: Sequence[tuple] = ()) -> None:
        """Keep the keys and values of `ids` ([1, kv_heads, >= len(ids), head_dim] a layer, copied
        here, or as they are where they are the prefix's own arrays: `copy` False, a file's); an
        entry whose ids this one extends is replaced by it. Keys by channel come with each layer's
        `copies` (KVCache.copies): their whole blocks are kept, and the copies where they reach
        back to the block of the last id."""
        ids = tuple(ids)
        if copy:
            by_channel = [bool(c) for c in copies] or [False] * len(layers)
            copies = [_cut_copies(c, len(ids)) for c in copies]
            layers = [(_copied(keys, whole_blocks(len(ids)) if whole else len(ids)), _copied(values, len(ids)))
                      for (keys, values), whole in zip(layers, by_channel)]
            mx.eval(layers, [c[0] for c in copies if c and c[0] is not None])
        self._add(ids, list(layers), copies=tuple(copies) if any(copies) else ())

    def take(self, ids: Sequence[int], model, max_kv_size: int = 0, keep: int = 0) -> tuple[list[KVCache], int]:
        """A cache to continue `ids` from: the entry sharing the longest prefix with them, taken
        out of the store (the caller owns its buffers now) and cut to that prefix, or a fresh cache
        (rotating, with a `max_kv_size`); and how many of `ids` it holds."""
        entry, length = self.lookup(ids, bounded=True)
        cache = model.make_cache(max_kv_size=max_kv_size, keep=keep)
        if entry is None:
            return cache, 0
        self.entries.remove(entry)
        _fill(cache, entry, length, lambda a, end: a)
        return cache, length

    def put(self, ids: Sequence[int], cache: Sequence[KVCache]) -> None:
        """Keep a cache its owner is done with for now, as it is (no copy), holding the first
        `cache[0].offset` of `ids`."""
        self._add(tuple(ids[: cache[0].offset]), [(layer.keys, layer.values) for layer in cache],
                  tuple(layer.start for layer in cache), tuple(layer.window for layer in cache),
                  tuple(layer.copies for layer in cache))

    def _add(self, ids: tuple[int, ...], layers: list[tuple[Buffer, Buffer]], starts: tuple[int, ...] = (),
             windows: tuple[int, ...] = (), copies: tuple[tuple, ...] = ()) -> None:
        """A new entry, replacing those whose ids it extends; then the least recently used go
        while the store is over its bound."""
        nbytes = sum(kv_nbytes(k) + kv_nbytes(v) for k, v in layers)
        if not ids or nbytes > self.max_bytes:
            return
        self.entries = [e for e in self.entries if e.ids != ids[: len(e.ids)]]
        self.entries.append(Entry(ids, layers, nbytes, next(self._clock), starts or (0,) * len(layers),
                                  windows or (0,) * len(layers), copies))
        while self.nbytes > self.max_bytes:
            self.entries.remove(min(self.entries, key=lambda e: e.used))


def _fill(cache: list[KVCache], entry: Entry, length: int, cut) -> None:
    """Give each layer of a fresh cache the entry's positions up to `length` (cut(buffer, slots) gives
    the buffer a layer takes: a view of the entry's, or the entry's own), and the copies of keys by
    channel that an entry put here as it was kept."""
    for i, (layer, (keys, values), start) in enumerate(zip(cache, entry.layers, entry.starts)):
        slots = layer.slots(start, length)
        by_channel = isinstance(keys, tuple) and layer.quantization.keys_by_channel
        layer.restore(cut(keys, whole_blocks(slots) if by_channel else slots), cut(values, slots), start, length,
                      entry.copies[i] if entry.copies else ())


def _copied(buffer: Buffer, slots: int) -> Buffer:
    """The first `slots` slots, contiguous: never a view that would keep the whole buffer alive."""
    return kv_map(lambda a: mx.contiguous(a[:, :, :slots]), buffer)


def _cut_copies(copies: tuple, length: int) -> tuple:
    """Keys by channel's copies (a buffer of positions `opened` on, and `opened`) cut to `length`
    positions, contiguous; () where they start after the block that position `length` falls in."""
    if not copies:
        return ()
    held, opened = copies
    if opened > block_start(length):
        return ()
    return (mx.contiguous(held[:, :, : length - opened]) if length > opened else None), opened


def common_prefix(a: Sequence[int], b: Sequence[int], most: int) -> int:
    """How many leading ids a and b share, at most `most`."""
    n = 0
    for x, y in zip(a, b):
        if x != y or n == most:
            break
        n += 1
    return n
