"""Per-layer key/value caches.

KVCache grows in fixed steps, so a decode step never copies the whole cache; SlidingKVCache keeps
only what a sliding-window layer can still attend to, so its memory stays bounded however long
the sequence; BatchKVCache holds rows of different lengths for batched decoding; SlotCache is a
KVCache's buffers inside the compiled decode step.
"""

from __future__ import annotations

import mlx.core as mx

GROWTH_STEP = 256


def causal_mask(length: int, offset: int = 0, window: int = 0) -> str | mx.array | None:
    """Each new token sees every cached position and the new tokens up to itself; with a sliding
    `window`, only the window - 1 positions before it (llama.cpp's and Hugging Face's convention).

    MLX's "causal" aligns the queries with the last keys, which is exactly that for any number
    of cached positions, and lets the fused attention skip the masked half.
    """
    if window and offset + length > window:
        return visible(offset + mx.arange(length)[:, None], mx.arange(offset + length)[None, :], window)
    return None if length == 1 else "causal"


def visible(query_pos: mx.array, key_pos: mx.array, window: int) -> mx.array:
    """Which keys each query attends to: its own position and before, within the window if any."""
    seen = key_pos <= query_pos
    return seen & (key_pos > query_pos - window) if window else seen


def keeps_window(start: int, window: int, length: int) -> bool:
    """Whether a layer cache whose first slot holds position `start`, cut to `length` positions,
    still holds all a later query sees: everything, or the window - 1 positions before `length`."""
    return start == 0 or (window > 0 and start <= length - (window - 1))


def kv_bytes_per_position(config, dtype: mx.Dtype) -> int:
    """Keys and values of every layer for one position of one sequence."""
    return config.n_layers * 2 * config.n_kv_heads * config.head_dim * dtype.size


class KVCache:
    window = 0  # it keeps every position (SlidingKVCache keeps a window)

    def __init__(self):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        # Number of positions filled; also the RoPE position of the next token.
        self.offset = 0

    def mask(self, length: int, window: int = 0) -> str | mx.array | None:
        return causal_mask(length, self.offset, window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append keys/values of shape [batch, kv_heads, new, head_dim]; return everything cached so far."""
        new = keys.shape[2]
        if self.keys is None or self.offset + new > self.keys.shape[2]:
            self._grow(keys, values, new)
        self.keys[..., self.offset : self.offset + new, :] = keys
        self.values[..., self.offset : self.offset + new, :] = values
        self.offset += new
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def _grow(self, keys: mx.array, values: mx.array, new: int) -> None:
        batch, heads, _, head_dim = keys.shape
        capacity = (self.offset + new + GROWTH_STEP - 1) // GROWTH_STEP * GROWTH_STEP
        grown_k = mx.zeros((batch, heads, capacity, head_dim), keys.dtype)
        grown_v = mx.zeros((batch, heads, capacity, values.shape[3]), values.dtype)
        if self.keys is not None and self.offset:
            grown_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
            grown_v[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = grown_k, grown_v

    def make_room(self, new: int) -> None:
        """Make the buffers (already allocated) hold `new` more positions, for a step that writes
        them in place (model.Transformer.step) and then calls advance."""
        if self.offset + new > self.keys.shape[2]:
            self._grow(self.keys, self.values, new)

    def advance(self, new: int) -> None:
        self.offset += new

    def trim(self, n: int) -> None:
        """Forget the last n positions (the storage is kept and overwritten later)."""
        self.offset = max(0, self.offset - n)

    @property
    def start(self) -> int:
        """The first position after any the cache dropped (0: it dropped none)."""
        return 0

    def slots(self, start: int, length: int) -> int:
        """How many buffer slots hold positions up to `length`, for a cache whose `start` was `start`."""
        return length

    def restore(self, keys: mx.array, values: mx.array, start: int, length: int) -> None:
        """Hold positions up to `length`, given as buffers laid out as this kind of cache lays
        them out when its `start` is `start` (the state a prompt cache keeps and gives back)."""
        self.keys, self.values, self.offset = keys, values, length

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]


class SlidingKVCache(KVCache):
    """A sliding-window layer's keys and values: only what a later query can still see.

    A query at position p sees p - window + 1 .. p, so between steps only the last window - 1
    positions are needed. The buffer keeps those and room for GROWTH_STEP more, so that it is
    rewritten (the kept positions moved to its front) once every GROWTH_STEP tokens rather than at
    every one; `start` is the position in its first slot. Memory: at most window - 1 + the tokens
    of one call + GROWTH_STEP positions.
    """

    def __init__(self, window: int):
        super().__init__()
        self.window = window
        self._start = 0

    @property
    def start(self) -> int:
        return self._start

    def holds(self, length: int) -> bool:
        """Whether cutting the cache to its first `length` positions leaves all a later query needs."""
        return length <= self.offset and keeps_window(self._start, self.window, length)

    def _start_after(self, new: int) -> int:
        """The position in the first slot once `new` more positions are appended."""
        if self.keys is None or self.offset - self._start + new <= self.keys.shape[2]:
            return self._start
        return max(self._start, self.offset - (self.window - 1))

    def mask(self, length: int, window: int = 0) -> str | mx.array | None:
        start = self._start_after(length)
        if self.offset - start < self.window and self.offset + length - start <= self.window:
            return causal_mask(length)  # every query sees every key it is not ahead of
        query_pos = self.offset + mx.arange(length)[:, None]
        return visible(query_pos, start + mx.arange(self.offset + length - start)[None, :], self.window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        new = keys.shape[2]
        start = self._start_after(new)
        if self.keys is None or start != self._start:
            self._rebuild(start, keys, values, new)
        slot = self.offset - self._start
        self.keys[..., slot : slot + new, :] = keys
        self.values[..., slot : slot + new, :] = values
        self.offset += new
        end = self.offset - self._start
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _rebuild(self, start: int, keys: mx.array, values: mx.array, new: int) -> None:
        """A buffer holding positions start .. offset - 1 of the old one and room for `new` + GROWTH_STEP more."""
        batch, heads, _, head_dim = keys.shape
        kept = self.offset - start
        capacity = kept + new + GROWTH_STEP
        grown_k = mx.zeros((batch, heads, capacity, head_dim), keys.dtype)
        grown_v = mx.zeros((batch, heads, capacity, values.shape[3]), values.dtype)
        if self.keys is not None and kept:
            first = start - self._start
            grown_k[..., :kept, :] = self.keys[..., first : first + kept, :]
            grown_v[..., :kept, :] = self.values[..., first : first + kept, :]
        self.keys, self.values, self._start = grown_k, grown_v, start

    def trim(self, n: int) -> None:
        """Forget the last n positions; the caller checks holds() first where it matters."""
        self.offset = max(self._start, self.offset - n)

    def slots(self, start: int, length: int) -> int:
        return length - start

    def restore(self, keys: mx.array, values: mx.array, start: int, length: int) -> None:
        """Hold positions start .. length - 1, given as buffers whose slot 0 is `start`."""
        self.keys, self.values, self._start, self.offset = keys, values, start, length


class RotatingKVCache(KVCache):
    """A layer's keys and values in bounded memory: the first `keep` positions (BOS, a system
    prompt) and the last `max_size - keep`, as llama.cpp's context shift and mlx-lm's rotating
    cache keep them, so a conversation can go on for ever. Positions keep advancing past what is
    dropped: RoPE sees each token's true position (past the trained context that is the model's
    extrapolation), and a query attends to the kept first positions and the `window` last ones.

    Slots 0 .. keep - 1 hold positions 0 .. keep - 1; slot keep + j holds position _start + j. As
    in SlidingKVCache, the buffer has room for GROWTH_STEP more and is rewritten, dropping what no
    later query sees, once every GROWTH_STEP tokens. Memory: at most max_size - 1 + the tokens of
    one call + GROWTH_STEP positions.
    """

    def __init__(self, max_size: int, keep: int):
        super().__init__()
        self.max_size, self.keep = max_size, keep
        self.window = max_size - keep
        self._start = keep

    @property
    def start(self) -> int:
        return 0 if self._start == self.keep else self._start

    def holds(self, length: int) -> bool:
        """Whether cutting the cache to its first `length` positions leaves all a later query needs."""
        return length <= self.offset and keeps_window(self.start, self.window, length)

    def slots(self, start: int, length: int) -> int:
        return length if start == 0 else self.keep + length - start

    def restore(self, keys: mx.array, values: mx.array, start: int, length: int) -> None:
        self.keys, self.values, self.offset = keys, values, length
        self._start = start or self.keep

    def _slots_after(self, new: int, start: int) -> int:
        return self.keep + self.offset + new - start

    def _start_after(self, new: int) -> int:
        """The position in slot `keep` once `new` more positions are appended."""
        if self.keys is None or self._slots_after(new, self._start) <= self.keys.shape[2]:
            return self._start
        return max(self._start, self.offset - (self.window - 1))

    def mask(self, length: int, window: int = 0) -> str | mx.array | None:
        start = self._start_after(length)
        if start == self.keep and self.offset + length <= self.max_size:
            return causal_mask(length)  # nothing dropped, and every query sees every key it is not ahead of
        slot = mx.arange(self._slots_after(length, start))
        key_pos = mx.where(slot < self.keep, slot, start + slot - self.keep)
        query_pos = self.offset + mx.arange(length)[:, None]
        return visible(query_pos, key_pos[None, :], self.window) | ((key_pos < self.keep) & (key_pos <= query_pos))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        new = keys.shape[2]
        start = self._start_after(new)
        if self.keys is None or start != self._start or self._slots_after(new, start) > self.keys.shape[2]:
            self._rebuild(start, keys, values, new)
        slot = self.keep + self.offset - self._start
        self.keys[..., slot : slot + new, :] = keys
        self.values[..., slot : slot + new, :] = values
        self.offset += new
        end = self.keep + self.offset - self._start
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _rebuild(self, start: int, keys: mx.array, values: mx.array, new: int) -> None:
        """A buffer holding positions 0 .. keep - 1 and start .. offset - 1 of the old one, and room
        for `new` + GROWTH_STEP more."""
        batch, heads, _, head_dim = keys.shape
        capacity = self._slots_after(new, start) + GROWTH_STEP
        grown_k = mx.zeros((batch, heads, capacity, head_dim), keys.dtype)
        grown_v = mx.zeros((batch, heads, capacity, values.shape[3]), values.dtype)
        if self.keys is not None and self.offset:
            head = min(self.keep, self.offset)
            grown_k[..., :head, :] = self.keys[..., :head, :]
            grown_v[..., :head, :] = self.values[..., :head, :]
            if self.offset > start:
                first, kept = self.keep + start - self._start, self.offset - start
                grown_k[..., self.keep : self.keep + kept, :] = self.keys[..., first : first + kept, :]
                grown_v[..., self.keep : self.keep + kept, :] = self.values[..., first : first + kept, :]
        self.keys, self.values, self._start = grown_k, grown_v, start

    def trim(self, n: int) -> None:
        self.offset = max(self.start, self.offset - n)


def rotates(cache) -> bool:
    """Whether a cache drops old positions (RotatingKVCache), so its positions may pass the context."""
    return any(isinstance(layer, RotatingKVCache) for layer in cache)


class SlotCache:
    """One layer's whole KVCache buffers inside a compiled decode step (model.Transformer.step).

    New keys/values are written at `position`, an array, so the step's shapes do not depend on
    how many positions are filled; attention reads every slot and `mask` hides the slots past
    the new token (zeros, or stale values after a trim).
    """

    def __init__(self, keys: mx.array, values: mx.array, position: mx.array):
        self.keys, self.values, self.position = keys, values, position

    @property
    def offset(self) -> mx.array:
        return self.position

    def mask(self, length: int, window: int = 0) -> mx.array:
        return visible(self.position + mx.arange(length)[:, None], mx.arange(self.keys.shape[2])[None, :], window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start = self.position.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
        self.values = mx.slice_update(self.values, values, start, axes=(2,))
        return self.keys, self.values


def make_cache(windows: list[int], bounded: bool = True, max_size: int = 0, keep: int = 0) -> list[KVCache]:
    """One cache a layer: a SlidingKVCache for a layer with a window (unless `bounded` is False:
    batching needs every position in its slot), else a KVCache, or with a `max_size` a
    RotatingKVCache keeping `keep` first positions."""
    def full() -> KVCache:
        return RotatingKVCache(max_size, keep) if max_size else KVCache()

    return [SlidingKVCache(w) if w and bounded else full() for w in windows]


class BatchKVCache:
    """One layer's keys/values for a batch of sequences of different lengths.

    Row i keeps position p in slot p, just where a single sequence's KVCache keeps it, so each row
    attends over the same values in the same order as it would alone; the slots past a row's
    length (zeros, or stale values of a row that left) are hidden by `mask`.
    """

    def __init__(self):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.lengths: list[int] = []
        # mx.array(lengths), built once per change: RoPE, the mask and the update all read it every step.
        self._offset: mx.array | None = None

    @property
    def offset(self) -> mx.array:
        """Per-row RoPE position of the next token."""
        if self._offset is None:
            self._offset = mx.array(self.lengths)
        return self._offset

    def mask(self, length: int, window: int = 0) -> mx.array:
        """[batch, 1, length, slots]: a row's new tokens see its cached positions and new tokens up to
        themselves (within the window, if any)."""
        query_pos = self.offset[:, None] + mx.arange(length)[None, :]
        key_pos = mx.arange(max(self.lengths) + length)
        return visible(query_pos[:, :, None], key_pos[None, None, :], window)[:, None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append keys/values [batch, kv_heads, new, head_dim], each row after its own length; return slots in use."""
        batch, _, new, _ = keys.shape
        end = max(self.lengths) + new
        self.make_room(new)
        slots = (self.offset[:, None] + mx.arange(new)[None, :]).reshape(batch, 1, new, 1)
        self.keys = mx.put_along_axis(self.keys, slots, keys, axis=2)
        self.values = mx.put_along_axis(self.values, slots, values, axis=2)
        self.lengths, self._offset = [n + new for n in self.lengths], None
        return self.keys[..., :end, :], self.values[..., :end, :]

    def add(self, cache: KVCache) -> None:
        """Append a single sequence's cache as a new last row."""
        length = cache.offset
        keys, values = cache.keys[..., :length, :], cache.values[..., :length, :]
        if self.keys is None:
            self.keys = mx.zeros((0, keys.shape[1], 0, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((0, values.shape[1], 0, values.shape[3]), values.dtype)
        self._reserve(length)
        room = self.keys.shape[2] - length
        pad = [(0, 0), (0, 0), (0, room), (0, 0)]
        self.keys = mx.concatenate([self.keys, mx.pad(keys, pad)])
        self.values = mx.concatenate([self.values, mx.pad(values, pad)])
        self.lengths, self._offset = self.lengths + [length], None

    def keep(self, rows: list[int]) -> None:
        """Drop every row not listed, so finished sequences cost no more compute."""
        if not rows:  # an unevaluated empty slice would keep the whole buffer alive until the next row
            self.__init__()
            return
        index = mx.array(rows, mx.int32)
        self.keys, self.values = self.keys[index], self.values[index]
        self.lengths, self._offset = [self.lengths[r] for r in rows], None

    def make_room(self, new: int) -> None:
        """Make the buffers hold `new` more positions after the longest row (as KVCache.make_room)."""
        self._reserve(max(self.lengths) + new)

    def advance(self, new: int) -> None:
        """Every row took `new` more positions, written in place (model.Transformer.step)."""
        self.lengths, self._offset = [n + new for n in self.lengths], None

    def _reserve(self, slots: int) -> None:
        capacity = self.keys.shape[2]
        if slots <= capacity:
            return
        grown = (slots + GROWTH_STEP - 1) // GROWTH_STEP * GROWTH_STEP
        pad = [(0, 0), (0, 0), (0, grown - capacity), (0, 0)]
        self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)


def make_batch_cache(n_layers: int) -> list[BatchKVCache]:
    return [BatchKVCache() for _ in range(n_layers)]
