"""Per-layer key/value caches.

KVCache grows in fixed steps, so a decode step never copies the whole cache; SlidingKVCache keeps
only what a sliding-window layer can still attend to, so its memory stays bounded however long
the sequence; RotatingKVCache bounds a full-attention layer's the same way; BatchKVCache holds rows
of different lengths for batched decoding, and RingKVCache bounds their memory. Every kind can
store its keys and values quantized (KVQuantization), its keys grouped by channel too
(keys_by_channel).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence, Union

import mlx.core as mx
import numpy as np

GROWTH_STEP = 256
# Keys stored by channel (KVQuantization.keys_by_channel) are quantized in blocks of this many
# slots, each channel of a block with a scale and bias of its own, as KIVI quantizes keys. It
# divides GROWTH_STEP, so a growing buffer always holds whole blocks.
CHANNEL_BLOCK = 32


# MLX's CUDA backend hands a one-position query to cuDNN's attention when the keys are a slice of a
# buffer whose length is a multiple of 256 (its test for mlx-lm's cache), and to its own vector
# kernel otherwise. For one sequence cuDNN's graph update costs the host more than it saves the GPU
# (docs/benchmarks.md, "The plain step against mlx-lm"), so a one-row buffer is one channel block
# longer: off that grid, and still whole blocks.
ONE_ROW_EXTRA = CHANNEL_BLOCK


def grown_size(slots: int, rows: int = 0) -> int:
    """The slots a growing buffer of `rows` rows allocates to hold `slots`: whole steps of
    GROWTH_STEP, and ONE_ROW_EXTRA more for one row."""
    return whole_blocks(slots, GROWTH_STEP) + (ONE_ROW_EXTRA if rows == 1 else 0)


# Keys or values [batch, kv_heads, slots, head_dim]: one array, or with a KVQuantization the three
# of mx.quantize (packed integers, scales, biases), each with the slots on axis 2.
Buffer = Union[mx.array, tuple]


@dataclass(frozen=True)
class KVQuantization:
    """Keys and values stored with MLX's affine quantization (`bits` a value, a scale and a bias
    every `group_size` values of a head) and attended with its quantized products, as mlx-lm's
    --kv-bits stores them; keys at `key_bits` where set (llama.cpp's -ctk beside -ctv: 4-bit keys
    lose far more than 4-bit values, docs/benchmarks.md). A cache holds its first `start` positions
    at full precision, and quantizes them with the rest once it holds more (mlx-lm's
    --quantized-kv-start).

    With `keys_by_channel`, keys are grouped along positions instead of along the head: each
    channel of a block of CHANNEL_BLOCK slots has its own scale and bias (KIVI). A key's outlying
    channels then no longer set the step of its other channels' codes, which is where 4-bit keys
    lose (docs/benchmarks.md, "Quantized KV cache"). A block is requantized whole while it fills,
    from full-precision copies of its keys that the cache keeps (KVCache's open block)."""

    bits: int
    group_size: int | None = None  # None: 64 (mlx-lm's), or 32 for heads of 64 values or fewer
    start: int = 0
    key_bits: int | None = None  # None: `bits`
    keys_by_channel: bool = False

    BITS = (4, 8)
    GROUP_SIZES = (32, 64, 128)

    @property
    def bits_of_keys(self) -> int:
        return self.key_bits or self.bits

    def for_heads(self, head_dim: int) -> KVQuantization:
        """These settings with the group size chosen for heads of head_dim values; a one-line error
        for settings MLX cannot quantize them with."""
        from .errors import MlxLlamaError

        if self.bits not in self.BITS:
            raise MlxLlamaError(f"--kv-bits must be 4 or 8, not {self.bits}")
        if self.bits_of_keys not in self.BITS:
            raise MlxLlamaError(f"--kv-key-bits must be 4 or 8, not {self.key_bits}")
        if self.start < 0:
            raise MlxLlamaError(f"--quantized-kv-start must be 0 or more, not {self.start}")
        # Two groups a head at least where the head allows: MLX's CUDA quantized product has no kernel
        # for heads of one group (Block.attention in models.transformer dequantizes those).
        group_size = self.group_size or (64 if head_dim >= 128 and head_dim % 64 == 0 else 32)
        if group_size not in self.GROUP_SIZES:
            raise MlxLlamaError(f"--kv-group-size must be 32, 64 or 128, not {group_size}")
        if head_dim % group_size:  # so heads are whole CHANNEL_BLOCKs too, as keys by channel need
            raise MlxLlamaError(f"--kv-group-size {group_size} does not divide the model's head size {head_dim}")
        return replace(self, group_size=group_size, key_bits=None if self.bits_of_keys == self.bits else self.key_bits)

    def applies(self, quantized: bool, held: int) -> bool:
        """Whether a cache whose buffers are (or are not yet) `quantized` stores quantized once it
        holds `held` positions: from the first that passes `start` on."""
        return quantized or held > self.start

    def encode(self, keys: mx.array, values: mx.array) -> tuple[tuple, tuple]:
        """Keys and values as the cache stores them; keys by channel from a block's first slot on,
        in whole blocks (channel_blocks)."""
        if self.keys_by_channel:
            stored_keys = channel_blocks(keys, self.bits_of_keys)
        else:
            stored_keys = tuple(mx.quantize(keys, self.group_size, self.bits_of_keys))
        return stored_keys, self.encode_values(values)

    def encode_values(self, values: mx.array) -> tuple:
        return tuple(mx.quantize(values, self.group_size, self.bits))

    def decode(self, keys: tuple, values: tuple) -> tuple[mx.array, mx.array]:
        """The keys and values `encode` stored, dequantized (keys by channel: as many as the values)."""
        values = mx.dequantize(*values, group_size=self.group_size, bits=self.bits)
        if self.keys_by_channel:
            return channel_blocks_decoded(keys, self.bits_of_keys)[:, :, : values.shape[2]], values
        return mx.dequantize(*keys, group_size=self.group_size, bits=self.bits_of_keys), values

    def bytes_per_value(self, dtype: mx.Dtype) -> float:
        """Storage of one key or value element, on average: its bits, and its group's scale and bias
        in `dtype` (keys by channel: a scale and bias a channel of CHANNEL_BLOCK slots)."""
        key_group = CHANNEL_BLOCK if self.keys_by_channel else self.group_size
        return (self.bits_of_keys + self.bits) / 16 + dtype.size / key_group + dtype.size / self.group_size


def channel_blocks(keys: mx.array, bits: int) -> tuple:
    """Keys [batch, kv_heads, n, head_dim] quantized in blocks of CHANNEL_BLOCK positions, one
    group a channel of a block; a last partial block is filled out with its last key. Laid out
    with slots on axis 2, as any buffer: a block's codes ([head_dim, CHANNEL_BLOCK positions]) and
    its head_dim scales and biases spread over its CHANNEL_BLOCK slots, which hold exactly what
    those slots hold in groups of CHANNEL_BLOCK along the head."""
    batch, heads, n, head_dim = keys.shape
    fill = -n % CHANNEL_BLOCK
    if fill:
        keys = mx.concatenate([keys, mx.repeat(keys[:, :, -1:], fill, axis=2)], axis=2)
    blocks = (n + fill) // CHANNEL_BLOCK
    by_channel = keys.reshape(batch, heads, blocks, CHANNEL_BLOCK, head_dim).swapaxes(3, 4)
    return tuple(a.reshape(batch, heads, n + fill, head_dim * a.shape[-1] // CHANNEL_BLOCK)
                 for a in mx.quantize(by_channel, CHANNEL_BLOCK, bits))


def channel_blocks_decoded(keys: tuple, bits: int) -> mx.array:
    """Keys [batch, kv_heads, slots, head_dim] from channel_blocks' buffer of whole blocks."""
    codes, scales, biases = keys
    batch, heads, slots, _ = codes.shape
    blocks, head_dim = slots // CHANNEL_BLOCK, scales.shape[-1] * CHANNEL_BLOCK
    per_channel = [a.reshape(batch, heads, blocks, head_dim, -1) for a in (codes, scales, biases)]
    by_channel = mx.dequantize(*per_channel, group_size=CHANNEL_BLOCK, bits=bits)
    return by_channel.swapaxes(3, 4).reshape(batch, heads, slots, head_dim)


def whole_blocks(slots: int, block: int = CHANNEL_BLOCK) -> int:
    """The slots of the blocks that hold slots 0 .. slots - 1."""
    return -(-slots // block) * block


def block_start(positions):
    """The first position of the block each of `positions` (an int, or a numpy array) falls in."""
    return positions - positions % CHANNEL_BLOCK


def kv_label(quantization: KVQuantization | None) -> str:
    """The settings that say how a cache stores keys and values, as the options give them."""
    if quantization is None:
        return "unquantized"
    keys = f" --kv-key-bits {quantization.key_bits}" if quantization.key_bits else ""
    keys += " --kv-keys-by-channel" if quantization.keys_by_channel else ""
    return (f"--kv-bits {quantization.bits}{keys} --kv-group-size {quantization.group_size}"
            f" --quantized-kv-start {quantization.start}")


def kv_map(fn: Callable[..., mx.array], *buffers: Buffer) -> Buffer:
    """fn applied to each array of the buffers (one each, or a quantized buffer's three in turn)."""
    if isinstance(buffers[0], tuple):
        return tuple(fn(*arrays) for arrays in zip(*buffers))
    return fn(*buffers)


def kv_arrays(buffer: Buffer) -> tuple:
    return buffer if isinstance(buffer, tuple) else (buffer,)


def kv_nbytes(buffer: Buffer) -> int:
    return sum(a.nbytes for a in kv_arrays(buffer))


def capacity(buffer: Buffer) -> int:
    return kv_arrays(buffer)[0].shape[2]


def slot_range(buffer: Buffer, begin: int, end: int) -> Buffer:
    """Slots begin .. end - 1 of a buffer (a view)."""
    # Written out rather than through kv_map: every layer calls this (and write) each decode step,
    # and the host's time bounds a step.
    if isinstance(buffer, tuple):
        return tuple(a[:, :, begin:end] for a in buffer)
    return buffer[:, :, begin:end]


def allocate(like: Buffer, slots: int, rows: int | None = None) -> Buffer:
    """Zeros of `slots` slots (and `rows` rows, default like's), laid out as `like`."""
    return kv_map(lambda a: mx.zeros((a.shape[0] if rows is None else rows, a.shape[1], slots) + a.shape[3:], a.dtype),
                  like)


def write(buffer: Buffer, slot: int, new: Buffer) -> None:
    """Put `new` into the buffer from `slot` on, in place."""
    if not isinstance(buffer, tuple):
        buffer[:, :, slot : slot + new.shape[2]] = new
        return
    for a, b in zip(buffer, new):
        a[:, :, slot : slot + b.shape[2]] = b


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


def kv_bytes_per_position(config, dtype: mx.Dtype, quantization: KVQuantization | None = None) -> int:
    """Keys and values of every layer for one position of one sequence."""
    per_value = quantization.bytes_per_value(dtype) if quantization else dtype.size
    return int(config.n_layers * 2 * config.n_kv_heads * config.head_dim * per_value)


class KVCache:
    window = 0  # it keeps every position (SlidingKVCache keeps a window)

    def __init__(self, quantization: KVQuantization | None = None):
        self.keys: Buffer | None = None
        self.values: Buffer | None = None
        # Number of positions filled; also the RoPE position of the next token.
        self.offset = 0
        self.quantization = quantization
        # Keys by channel (KVQuantization.keys_by_channel): full-precision copies of the keys from
        # position _open_from (a block's first) on, of the last block, not yet full, which each write
        # stores again with its new keys, and of the full block before it, so that trimming a few
        # positions (speculative decoding's rejected drafts) leaves the copies of what is kept.
        self._open: mx.array | None = None
        self._open_from = 0

    @property
    def quantized(self) -> bool:
        """Whether the buffers hold quantized keys and values now (KVQuantization.start passed)."""
        return isinstance(self.keys, tuple)

    def stores_quantized(self, new: int) -> bool:
        """Whether the buffers hold quantized keys and values once `new` more positions are appended."""
        return self.quantization is not None and self.quantization.applies(self.quantized, self.offset + new)

    @property
    def keys_by_channel(self) -> bool:
        """Whether the keys are stored by channel, in whole blocks (KVQuantization.keys_by_channel)."""
        return self.quantized and self.quantization.keys_by_channel

    @property
    def block(self) -> int:
        """The slots a buffer is laid out, moved and copied by: CHANNEL_BLOCK where keys are (or will
        be) stored by channel, else 1."""
        return CHANNEL_BLOCK if self.quantization is not None and self.quantization.keys_by_channel else 1

    def _stored(self, keys: mx.array, values: mx.array) -> tuple[Buffer, Buffer, int]:
        """New keys and values [batch, kv_heads, new, head_dim] as the buffers will store them once
        they are appended (stores_quantized), the buffers held so far quantized first when that
        starts now; and the position the stored keys start at: the next one, but for keys by
        channel, which store the last block again whole, its earlier keys with the new ones."""
        if not self.stores_quantized(keys.shape[2]):
            return keys, values, self.offset
        if not self.quantized and self.keys is not None:
            if self.quantization.keys_by_channel:
                first = max(self.start, block_start(self.offset) - CHANNEL_BLOCK)
                held = slot_range(self.keys, self.slot_of(first), self.slot_of(self.offset))
                self._open, self._open_from = (held if self.offset > first else None), first
            self.keys, self.values = self.quantization.encode(self.keys, self.values)
        if not self.quantization.keys_by_channel:
            return *self.quantization.encode(keys, values), self.offset
        if self._open is not None:
            keys = mx.concatenate([self._open, keys], axis=2)  # positions _open_from on
        first, end = block_start(self.offset), self._open_from + keys.shape[2]
        kept_from = max(self._open_from, block_start(end) - CHANNEL_BLOCK)
        stored = self.quantization.encode(keys[:, :, first - self._open_from :], values)
        self._open, self._open_from = keys[:, :, kept_from - self._open_from :], kept_from
        return *stored, first

    def _reopen(self, copies_kept: bool = True) -> None:
        """Keys by channel, after trimming or restoring: the copies cut to the positions kept, or
        where they no longer reach back to the block of the next position (or are gone:
        `copies_kept` False), that block's keys as the buffer holds them (rounded once more when
        the block is stored again)."""
        if not self.keys_by_channel:
            return
        first = block_start(self.offset)
        filled = self.offset - first
        if copies_kept and self._open_from <= first:
            kept = self.offset - self._open_from
            self._open = self._open[:, :, :kept] if kept else None
            return
        self._open_from = first
        if not filled:
            self._open = None
            return
        block = slot_range(self.keys, self.slot_of(first), self.slot_of(first) + CHANNEL_BLOCK)
        self._open = channel_blocks_decoded(block, self.quantization.bits_of_keys)[:, :, :filled]

    def fetched(self, end: int) -> tuple[Buffer, Buffer]:
        """The buffers' slots up to `end`: keys by channel to the end of its block (attention
        decodes them and cuts them to the values', KVQuantization.decode)."""
        key_end = whole_blocks(end) if self.keys_by_channel else end
        return slot_range(self.keys, 0, key_end), slot_range(self.values, 0, end)

    def mask(self, length: int, window: int = 0) -> str | mx.array | None:
        return causal_mask(length, self.offset, window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Buffer, Buffer]:
        """Append keys/values of shape [batch, kv_heads, new, head_dim]; return everything cached so far."""
        new = keys.shape[2]
        end = self.offset + new
        if self.quantization is None and self.keys is not None and end <= self.keys.shape[2]:
            # What nearly every decode step finds, written out: every layer makes this call each step,
            # and building the step's graph is host time, which bounds a step.
            self.keys[:, :, self.offset : end] = keys
            self.values[:, :, self.offset : end] = values
            self.offset = end
            return self.keys[:, :, :end], self.values[:, :, :end]
        keys, values, keys_from = self._stored(keys, values)
        # The values' room decides: keys by channel may hold whole blocks past it (a file's prefix).
        if self.keys is None or self.offset + new > capacity(self.values):
            self._grow(keys, values, new)
        write(self.keys, keys_from, keys)
        write(self.values, self.offset, values)
        self.offset += new
        return self.fetched(self.offset)

    def _grow(self, keys: Buffer, values: Buffer, new: int) -> None:
        size = grown_size(self.offset + new, kv_arrays(keys)[0].shape[0])
        grown_k, grown_v = allocate(keys, size), allocate(values, size)
        if self.keys is not None and self.offset:
            self._copy(grown_k, grown_v, 0, 0, self.offset)
        self.keys, self.values = grown_k, grown_v

    def _copy(self, keys: Buffer, values: Buffer, to: int, first: int, count: int) -> None:
        """Slots first .. first + count - 1 of the buffers into `keys` and `values` from slot `to`
        (keys by channel: the whole blocks that hold them)."""
        held_keys, held_values = self.fetched(first + count)
        write(keys, to, slot_range(held_keys, first, capacity(held_keys)))
        write(values, to, slot_range(held_values, first, first + count))

    def make_room(self, new: int) -> None:
        """Make the buffers (already allocated) hold `new` more positions, for a step that writes
        them in place (the CUDA kernels: mlxllama.cuda) and then calls advance."""
        if self.offset + new > capacity(self.values):
            self._grow(self.keys, self.values, new)

    def advance(self, new: int) -> None:
        self.offset += new

    def trim(self, n: int) -> None:
        """Forget the last n positions (the storage is kept and overwritten later)."""
        self.offset = max(0, self.offset - n)
        self._reopen()

    @property
    def start(self) -> int:
        """The first position after any the cache dropped (0: it dropped none)."""
        return 0

    def slots(self, start: int, length: int) -> int:
        """How many buffer slots hold positions up to `length`, for a cache whose `start` was `start`."""
        return length

    def slot_of(self, position: int) -> int:
        """The slot that holds `position`."""
        return position - self.start

    @property
    def copies(self) -> tuple:
        """Keys by channel: the full-precision copies of the last blocks' keys and the position they
        start from, which restore takes back; else ()."""
        return (self._open, self._open_from) if self.keys_by_channel else ()

    def restore(self, keys: Buffer, values: Buffer, start: int, length: int, copies: tuple = ()) -> None:
        """Hold positions up to `length`, given as buffers laid out as this kind of cache lays
        them out when its `start` is `start` (the state a prompt cache keeps and gives back), and
        keys by channel's `copies` where they were kept with them."""
        self.keys, self.values, self.offset = keys, values, length
        if copies:
            self._open, self._open_from = copies
        self._reopen(copies_kept=bool(copies))

    def held(self) -> tuple[np.ndarray, np.ndarray]:
        """The positions the buffers hold and the slot each is in, in order of position."""
        return np.arange(self.offset), np.arange(self.offset)

    @property
    def state(self) -> list[mx.array]:
        buffers = (self.keys, self.values, self._open)
        return [a for buffer in buffers if buffer is not None for a in kv_arrays(buffer)]


class SlidingKVCache(KVCache):
    """A sliding-window layer's keys and values: only what a later query can still see.

    A query at position p sees p - window + 1 .. p, so between steps only the last window - 1
    positions are needed. The buffer keeps those and room for GROWTH_STEP more, so that it is
    rewritten (the kept positions moved to its front) once every GROWTH_STEP tokens rather than at
    every one; `start` is the position in its first slot. Memory: at most window - 1 + the tokens
    of one call + GROWTH_STEP positions.
    """

    def __init__(self, window: int, quantization: KVQuantization | None = None):
        super().__init__(quantization)
        self.window = window
        self._start = 0

    @property
    def start(self) -> int:
        return self._start

    def holds(self, length: int) -> bool:
        """Whether cutting the cache to its first `length` positions leaves all a later query needs."""
        return length <= self.offset and keeps_window(self._start, self.window, length)

    def _start_after(self, new: int) -> int:
        """The position in the first slot once `new` more positions are appended (with keys by
        channel, a whole number of blocks on: the blocks stay whole)."""
        if self.keys is None or self.offset - self._start + new <= capacity(self.values):
            return self._start
        start = max(self._start, self.offset - (self.window - 1))
        return start - (start - self._start) % self.block

    def mask(self, length: int, window: int = 0) -> str | mx.array | None:
        start = self._start_after(length)
        if self.offset - start < self.window and self.offset + length - start <= self.window:
            return causal_mask(length)  # every query sees every key it is not ahead of
        query_pos = self.offset + mx.arange(length)[:, None]
        return visible(query_pos, start + mx.arange(self.offset + length - start)[None, :], self.window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Buffer, Buffer]:
        new = keys.shape[2]
        keys, values, keys_from = self._stored(keys, values)
        start = self._start_after(new)
        # Rebuilt also where the window has not passed the first slot yet, but the new positions
        # are more than the room left (a prefill chunk, when the window is wider than it and GROWTH_STEP).
        if self.keys is None or start != self._start or self.offset + new - start > capacity(self.values):
            self._rebuild(start, keys, values, new)
        write(self.keys, keys_from - self._start, keys)
        write(self.values, self.offset - self._start, values)
        self.offset += new
        return self.fetched(self.offset - self._start)

    def _rebuild(self, start: int, keys: Buffer, values: Buffer, new: int) -> None:
        """A buffer holding positions start .. offset - 1 of the old one and room for `new` + GROWTH_STEP more."""
        kept = self.offset - start
        size = whole_blocks(kept + new + GROWTH_STEP, self.block)
        grown_k, grown_v = allocate(keys, size), allocate(values, size)
        if self.keys is not None and kept:
            self._copy(grown_k, grown_v, 0, start - self._start, kept)
        self.keys, self.values, self._start = grown_k, grown_v, start

    def trim(self, n: int) -> None:
        """Forget the last n positions; the caller checks holds() first where it matters."""
        self.offset = max(self._start, self.offset - n)
        self._reopen()

    def slots(self, start: int, length: int) -> int:
        return length - start

    def held(self) -> tuple[np.ndarray, np.ndarray]:
        return np.arange(self._start, self.offset), np.arange(self.offset - self._start)

    def restore(self, keys: Buffer, values: Buffer, start: int, length: int, copies: tuple = ()) -> None:
        """Hold positions start .. length - 1, given as buffers whose slot 0 is `start`."""
        self._start = start
        super().restore(keys, values, start, length, copies)


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

    def __init__(self, max_size: int, keep: int, quantization: KVQuantization | None = None):
        check_kv_size(max_size, keep, quantization)
        super().__init__(quantization)
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

    def slot_of(self, position: int) -> int:
        return position if position < self.keep else self.keep + position - self._start

    def held(self) -> tuple[np.ndarray, np.ndarray]:
        head = np.arange(min(self.keep, self.offset))
        rest = np.arange(max(self._start, self.keep), self.offset)
        return np.concatenate([head, rest]), np.concatenate([head, self.keep + rest - self._start])

    def restore(self, keys: Buffer, values: Buffer, start: int, length: int, copies: tuple = ()) -> None:
        self._start = start or self.keep
        super().restore(keys, values, start, length, copies)

    def _slots_after(self, new: int, start: int) -> int:
        return self.keep + self.offset + new - start

    def _start_after(self, new: int) -> int:
        """The position in slot `keep` once `new` more positions are appended (with keys by
        channel, a whole number of blocks on: the blocks stay whole)."""
        if self.keys is None or self._slots_after(new, self._start) <= capacity(self.values):
            return self._start
        start = max(self._start, self.offset - (self.window - 1))
        return start - (start - self._start) % self.block

    def mask(self, length: int, window: int = 0) -> str | mx.array | None:
        start = self._start_after(length)
        if start == self.keep and self.offset + length <= self.max_size:
            return causal_mask(length)  # nothing dropped, and every query sees every key it is not ahead of
        slot = mx.arange(self._slots_after(length, start))
        key_pos = mx.where(slot < self.keep, slot, start + slot - self.keep)
        query_pos = self.offset + mx.arange(length)[:, None]
        return visible(query_pos, key_pos[None, :], self.window) | ((key_pos < self.keep) & (key_pos <= query_pos))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Buffer, Buffer]:
        new = keys.shape[2]
        keys, values, keys_from = self._stored(keys, values)
        start = self._start_after(new)
        if self.keys is None or start != self._start or self._slots_after(new, start) > capacity(self.values):
            self._rebuild(start, keys, values, new)
        # Keys by channel start a block before the next position: in the same part of the buffer,
        # since keep is whole blocks.
        write(self.keys, self.slot_of(keys_from), keys)
        write(self.values, self.slot_of(self.offset), values)
        self.offset += new
        return self.fetched(self.keep + self.offset - self._start)

    def _rebuild(self, start: int, keys: Buffer, values: Buffer, new: int) -> None:
        """A buffer holding positions 0 .. keep - 1 and start .. offset - 1 of the old one, and room
        for `new` + GROWTH_STEP more (keys by channel: whole blocks of each)."""
        size = whole_blocks(self._slots_after(new, start) + GROWTH_STEP, self.block)
        grown_k, grown_v = allocate(keys, size), allocate(values, size)
        if self.keys is not None and self.offset:
            head = min(self.keep, self.offset)
            self._copy(grown_k, grown_v, 0, 0, head)
            if self.offset > start:
                self._copy(grown_k, grown_v, self.keep, self.keep + start - self._start, self.offset - start)
        self.keys, self.values, self._start = grown_k, grown_v, start

    def trim(self, n: int) -> None:
        self.offset = max(self.start, self.offset - n)
        self._reopen()


def check_kv_size(max_kv_size: int, keep: int, quantization: KVQuantization | None = None) -> None:
    """A rotating cache's bounds: keep >= 0 first positions, and room for more than them; with keys
    by channel, whole blocks of them (the window's blocks then start at a block's first slot)."""
    from .errors import MlxLlamaError

    if max_kv_size < 0:
        raise MlxLlamaError("--max-kv-size must be 0 (off) or positive")
    if max_kv_size and not 0 <= keep < max_kv_size - 1:
        raise MlxLlamaError(f"--max-kv-size {max_kv_size} must exceed --keep {keep} by at least 2")
    if max_kv_size and quantization is not None and quantization.keys_by_channel and keep % CHANNEL_BLOCK:
        raise MlxLlamaError(f"--kv-keys-by-channel with --max-kv-size needs --keep to be a multiple of"
                            f" {CHANNEL_BLOCK} (0, {CHANNEL_BLOCK}, {2 * CHANNEL_BLOCK}...), not {keep}")


def rotates(cache) -> bool:
    """Whether a cache drops old positions (RotatingKVCache, RingKVCache), so its positions may pass
    the context and are not in the slots of their number."""
    return any(isinstance(layer, (RotatingKVCache, RingKVCache)) for layer in cache)


def make_cache(windows: list[int], bounded: bool = True, max_size: int = 0, keep: int = 0,
               quantization: KVQuantization | None = None) -> list[KVCache]:
    """One cache a layer: a SlidingKVCache for a layer with a window (unless `bounded` is False:
    batching needs every position in its slot), else a KVCache, or with a `max_size` a
    RotatingKVCache keeping `keep` first positions; each storing as `quantization` says."""
    def full() -> KVCache:
        return RotatingKVCache(max_size, keep, quantization) if max_size else KVCache(quantization)

    return [SlidingKVCache(w, quantization) if w and bounded else full() for w in windows]


class BatchKVCache:
    """One layer's keys/values for a batch of sequences of different lengths.

    Row i keeps position p in slot p, just where a single sequence's KVCache keeps it, so each row
    attends over the same values in the same order as it would alone; the slots past a row's
    length (zeros, or stale values of a row that left) are hidden by `mask`. With a quantization,
    the rows are stored quantized once the longest passes its start, or once a quantized row joins.
    Keys by channel keep each row's full-precision copies of the keys of the block it fills (from
    the block of its length before the last call on), as KVCache keeps one sequence's, in one
    array: slot j of row r holds position _open_from[r] + j.
    """

    def __init__(self, quantization: KVQuantization | None = None):
        self.keys: Buffer | None = None
        self.values: Buffer | None = None
        self.lengths: list[int] = []
        self.quantization = quantization
        # mx.array(lengths), built once per change: RoPE, the mask and the update all read it every step.
        self._offset: mx.array | None = None
        self._open: mx.array | None = None  # [rows, kv_heads, slots, head_dim]; None: no row has copies
        self._open_from: list[int] = []
        self._real_lengths: np.ndarray | None = None  # padded(): the next call's rows' lengths but for padding

    @property
    def offset(self) -> mx.array:
        """Per-row RoPE position of the next token."""
        if self._offset is None:
            self._offset = mx.array(self.lengths)
        return self._offset

    @property
    def quantized(self) -> bool:
        return isinstance(self.keys, tuple)

    @property
    def keys_by_channel(self) -> bool:
        return self.quantized and self.quantization.keys_by_channel

    @property
    def one_length(self) -> int | None:
        """The rows' length where they all have one (a lone row: a server with one client), else None."""
        return self.lengths[0] if len(set(self.lengths)) == 1 else None

    def stores_quantized(self, new: int) -> bool:
        """Whether the rows hold quantized keys and values once `new` more positions are appended to each."""
        return self.quantization is not None and self.quantization.applies(self.quantized, max(self.lengths) + new)

    def _stored(self, keys: mx.array, values: mx.array) -> tuple[Buffer, Buffer, np.ndarray | None]:
        """New keys and values [batch, kv_heads, new, head_dim] as the rows store them once they are
        appended (stores_quantized), the rows held so far quantized first when that starts now; and
        for keys by channel, which store the blocks the new keys fall in again whole
        (_blocks_with), the position of each stored key, [batch, stored] (else None: the values')."""
        if not self.stores_quantized(keys.shape[2]):
            return keys, values, None
        self._quantize()
        if not self.quantization.keys_by_channel:
            return *self.quantization.encode(keys, values), None
        keys, positions = self._blocks_with(keys)
        return keys, self.quantization.encode_values(values), positions

    def _blocks_with(self, keys: mx.array) -> tuple[tuple, np.ndarray]:
        """Keys by channel: the blocks each row's new keys fall in, quantized whole from the row's
        copies and the new keys (as KVCache stores them), and the position of each stored key. A
        row whose keys fall in fewer blocks than another's stores its last block again to the same
        slots rather than one it has not reached, which a ring may still hold positions of. The
        copies then kept start at the block of the row's length before these keys: cut_rows (a
        grouped prefill's padding, rejected drafts) never cuts a row back further."""
        rows, heads, new, head_dim = keys.shape
        lengths, opened = np.array(self.lengths), np.array(self._open_from)
        ends, firsts = lengths + new, block_start(lengths)
        real_ends = ends if self._real_lengths is None else np.minimum(ends, self._real_lengths)
        held = int((lengths - opened).max())
        window = mx.zeros((rows, heads, held + new, head_dim), keys.dtype)
        if held:
            window[:, :, :held] = self._open[:, :, :held]
        window = mx.put_along_axis(window, slot_index(lengths - opened, new), keys, axis=2)
        blocks = -(-(ends - firsts) // CHANNEL_BLOCK)
        block = np.minimum(np.arange(blocks.max()), blocks[:, None] - 1)
        positions = (firsts[:, None, None] + CHANNEL_BLOCK * block[:, :, None] + np.arange(CHANNEL_BLOCK)).reshape(rows, -1)
        # past a row's last key (or its last before padding), that key again: channel_blocks' filling of a partial block
        taken = np.minimum(positions, real_ends[:, None] - 1) - opened[:, None]
        stored = channel_blocks(mx.take_along_axis(window, slot_index(taken), axis=2), self.quantization.bits_of_keys)
        copied = np.minimum((firsts - opened)[:, None] + np.arange(int((ends - firsts).max())), held + new - 1)
        self._open, self._open_from = mx.take_along_axis(window, slot_index(copied), axis=2), firsts.tolist()
        return stored, positions

    def _joined(self, keys: Buffer, values: Buffer, length: int) -> tuple[Buffer, Buffer, tuple]:
        """An unquantized joining row's keys and values [1, kv_heads, slots, head_dim] (laid out as
        this cache lays a row out) stored quantized, as the rows are; and for keys by channel, its
        copies (row_copies)."""
        copies = ()
        if self.quantization.keys_by_channel:
            first = block_start(length)
            copies = (self._taken(keys, np.array([first]), length - first), first)
        return *self.quantization.encode(keys, values), copies

    def _taken(self, keys: mx.array, firsts: np.ndarray, width: int) -> mx.array | None:
        """Each row's keys from position firsts[row] on, `width` of them (None: 0), from full-precision
        keys laid out as this cache lays them out."""
        if not width:
            return None
        positions = firsts[:, None] + np.arange(width)
        return mx.take_along_axis(keys, slot_index(np.minimum(self._slot(positions), capacity(keys) - 1)), axis=2)

    def _quantize(self) -> None:
        """The rows held so far stored quantized (rows that all joined empty hold nothing yet: the
        first update lays the buffers out quantized); keys by channel keep each row's copies."""
        if self.keys is None or self.quantized:
            return
        if self.quantization.keys_by_channel:
            lengths = np.array(self.lengths)
            firsts = block_start(lengths)
            self._open, self._open_from = self._taken(self.keys, firsts, int((lengths - firsts).max(initial=0))), firsts.tolist()
        self.keys, self.values = self.quantization.encode(self.keys, self.values)

    def mask(self, length: int, window: int = 0) -> str | mx.array | None:
        """[batch, 1, length, slots]: a row's new tokens see its cached positions and new tokens up to
        themselves (within the window, if any). Rows all of one length (a lone row: a server with one
        client) take a single sequence's mask instead, None or "causal" outside a window, which MLX's
        fused attention takes as it is; an array mask makes its CUDA build run the products apart."""
        if self.one_length is not None:
            return causal_mask(length, self.one_length, window)
        query_pos = self.offset[:, None] + mx.arange(length)[None, :]
        key_pos = mx.arange(max(self.lengths) + length)
        return visible(query_pos[:, :, None], key_pos[None, None, :], window)[:, None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Buffer, Buffer]:
        """Append keys/values [batch, kv_heads, new, head_dim], each row after its own length; return slots in use."""
        batch, _, new, _ = keys.shape
        end = max(self.lengths) + new
        keys, values, key_positions = self._stored(keys, values)
        if self.keys is None:  # every row joined empty (add): the first update sets the layout
            self.keys, self.values = allocate(keys, 0, batch), allocate(values, 0, batch)
        self.make_room(new)
        values_at = self._where(new)
        keys_at = values_at if key_positions is None else self._where(key_positions.shape[1], key_positions)
        self.keys, self.values = self._put(self.keys, keys, keys_at), self._put(self.values, values, values_at)
        self.lengths, self._offset = [n + new for n in self.lengths], None
        return self.fetched(end)

    def _where(self, new: int, positions: np.ndarray | None = None) -> int | mx.array:
        """Where to write `new` positions a row, at `positions` [batch, new] (None: each row's next):
        the first slot of the one run of slots every row writes, as KVCache writes, or the index
        mx.put_along_axis takes, built on the host, as the lengths are (computed on the device it
        was two launches a layer)."""
        if positions is None:
            start = self.one_length
            if start is not None and self.in_order(start + new):
                return start
            return slot_index(self._slot(np.array(self.lengths)[:, None] + np.arange(new)))
        slots = self._slot(positions)
        if (slots == slots[0, 0] + np.arange(new)).all():
            return int(slots[0, 0])
        return slot_index(slots)

    @staticmethod
    def _put(buffer: Buffer, new: Buffer, where: int | mx.array) -> Buffer:
        """The buffer with `new` [batch, kv_heads, n, ...] written where _where says."""
        if isinstance(where, int):
            write(buffer, where, new)
            return buffer
        return kv_map(lambda a, b: mx.put_along_axis(a, where, b, axis=2), buffer, new)

    def _slot(self, positions: np.ndarray) -> np.ndarray:
        return positions

    def fetched(self, end: int) -> tuple[Buffer, Buffer]:
        """Slots up to `end`: keys by channel to the end of its block (as KVCache.fetched)."""
        return slot_range(self.keys, 0, whole_blocks(end) if self.keys_by_channel else end), slot_range(self.values, 0, end)

    def add(self, cache: KVCache) -> None:
        """Append a single sequence's cache as a new last row (an empty one too)."""
        self.extend([cache])

    def extend(self, caches: Sequence[KVCache]) -> None:
        """Append single sequences' caches (empty ones too) as new last rows: each buffer is made
        once, zeros with the rows before copied in and each joiner written after them, one copy a
        joiner. The launches are what a burst costs on CUDA, where MLX builds a CUDA graph anew
        for every sequence of launches it has not met: padding each joiner and concatenating took
        three a joiner, and a served burst's first step 41-59 ms against 19-24 ms now, on an H100
        (docs/benchmarks.md)."""
        if not caches:
            return
        lengths = [cache.offset for cache in caches]
        filled = [cache for cache in caches if cache.keys is not None]
        if not filled and self.keys is None:  # the buffers take their layout from the first update
            self._add_rows(lengths, [(None, 0)] * len(caches))
            return
        if self.keys is None:  # the rows before were empty: laid out as the first joiner's
            first = filled[0]
            self.keys, self.values = allocate(first.keys, 0, len(self.lengths)), allocate(first.values, 0, len(self.lengths))
        if any(cache.quantized for cache in filled):  # then every row is stored quantized
            self._quantize()
        rows, copies = [], []
        for cache, length in zip(caches, lengths):
            if cache.keys is None:  # laid out as the rows already are
                rows.append((allocate(self.keys, 0, 1), allocate(self.values, 0, 1)))
                copies.append((None, 0))
            elif self.quantized and not cache.quantized:
                *row, row_copies = self._joined(*cache.fetched(length), length)
                rows.append(row)
                copies.append(row_copies)
            else:
                rows.append(cache.fetched(length))
                copies.append(cache.copies)
        before, held, longest = len(self.lengths), capacity(self.keys), max(lengths)
        slots = held if longest <= held else grown_size(longest)

        def joined(buffer: mx.array, *new: mx.array) -> mx.array:
            out = mx.zeros((before + len(new), buffer.shape[1], slots) + buffer.shape[3:], buffer.dtype)
            if before and held:
                out[:before, :, :held] = buffer
            for i, a in enumerate(new):
                if a.shape[2]:
                    out[before + i : before + i + 1, :, : a.shape[2]] = a
            return out

        self.keys = kv_map(joined, self.keys, *(keys for keys, _ in rows))
        self.values = kv_map(joined, self.values, *(values for _, values in rows))
        self._add_rows(lengths, [c or (None, 0) for c in copies])

    def _add_rows(self, lengths: list[int], copies: list[tuple]) -> None:
        """New last rows of these lengths, with their keys by channel's copies ((None, 0): none)."""
        if self.quantization is not None and self.quantization.keys_by_channel:
            before = (self._open, len(self.lengths))
            self._open = stacked_rows([before] + [(open_keys, 1) for open_keys, _ in copies])
            self._open_from = self._open_from + [opened for _, opened in copies]
        self.lengths, self._offset = self.lengths + lengths, None

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not listed, so finished sequences cost no more compute."""
        if not rows:  # an unevaluated empty slice would keep the whole buffer alive until the next row
            self.keys = self.values = self._offset = self._open = None
            self.lengths, self._open_from = [], []
            return
        index = mx.array(rows, mx.int32)
        self.keys, self.values = kv_map(lambda a: a[index], self.keys), kv_map(lambda a: a[index], self.values)
        if self._open is not None:
            self._open = self._open[index]
        self._open_from = [self._open_from[r] for r in rows] if self._open_from else []
        self.lengths, self._offset = [self.lengths[r] for r in rows], None

    def make_room(self, new: int) -> None:
        """Make the buffers hold `new` more positions after the longest row (as KVCache.make_room)."""
        self._reserve(max(self.lengths) + new)

    def advance(self, new: int) -> None:
        """Every row took `new` more positions, written in place (model.Transformer.step)."""
        self.lengths, self._offset = [n + new for n in self.lengths], None

    def in_order(self, length: int) -> bool:
        """Whether a row of `length` positions holds position p in slot p (what the prompt store keeps)."""
        return True

    def row(self, i: int) -> tuple[Buffer, Buffer]:
        """Row i's keys and values (views), [1, kv_heads, slots, head_dim]."""
        return kv_map(lambda a: a[i : i + 1], self.keys), kv_map(lambda a: a[i : i + 1], self.values)

    def row_copies(self, i: int) -> tuple:
        """Row i's copies of its last blocks' keys (a view) and the position they start from, as
        KVCache.copies gives a single sequence's; () but for keys by channel."""
        if not self.keys_by_channel:
            return ()
        width = self.lengths[i] - self._open_from[i]
        return (self._open[i : i + 1, :, :width] if width else None), self._open_from[i]

    def padded(self, lengths: list[int]) -> None:
        """The next call pads row i past lengths[i] (a grouped prefill's rests, rows with fewer
        drafts), and cut_rows will cut it there: keys by channel store the padding as the row's
        last key before it, so that its block's codes are those its own keys give, as alone."""
        self._real_lengths = np.array(lengths)

    def cut_rows(self, lengths: list[int]) -> None:
        """Row i holds its first lengths[i] positions only: what a call wrote past them (a grouped
        prefill's padding) is forgotten, as KVCache.trim forgets; never fewer than it held before
        that call (keys by channel's copies reach back that far, _blocks_with)."""
        self.lengths, self._offset, self._real_lengths = list(lengths), None, None

    def single(self, i: int) -> KVCache:
        """Row i as a single sequence's cache of its own (a copy of the slots it holds)."""
        length = self.lengths[i]
        cache = KVCache(self.quantization)
        copies = self.row_copies(i)
        if copies and copies[0] is not None:
            copies = mx.contiguous(copies[0]), copies[1]
        cache.restore(*(kv_map(lambda a: mx.contiguous(a[i : i + 1]), b) for b in self.fetched(length)), 0, length, copies)
        return cache

    def _reserve(self, slots: int) -> None:
        held = capacity(self.keys)
        if slots <= held:
            return
        pad = [(0, 0), (0, 0), (0, grown_size(slots) - held), (0, 0)]
        self.keys, self.values = kv_map(lambda a: mx.pad(a, pad), self.keys), kv_map(lambda a: mx.pad(a, pad), self.values)


def slot_index(slots: np.ndarray, new: int = 0) -> mx.array:
    """Slots [rows, n] (or each row's first of `new` in a row: slots [rows]) as the index
    mx.take_along_axis and mx.put_along_axis take along a buffer's slots."""
    if new:
        slots = slots[:, None] + np.arange(new)
    return mx.array(slots.reshape(slots.shape[0], 1, -1, 1))


def stacked_rows(parts: list[tuple[mx.array | None, int]]) -> mx.array | None:
    """Arrays [rows, kv_heads, width, head_dim] of different widths (None: that many rows of width
    0) as one, each filled out with zeros to the widest; None where every part is None."""
    like = next((a for a, _ in parts if a is not None), None)
    if like is None:
        return None
    width = max(a.shape[2] for a, _ in parts if a is not None)
    out = [mx.zeros((rows, like.shape[1], width, like.shape[3]), like.dtype) if a is None
           else mx.pad(a, [(0, 0), (0, 0), (0, width - a.shape[2]), (0, 0)]) for a, rows in parts]
    return mx.concatenate([a for a in out if a.shape[0]])


def ring_slots(max_size: int, keep: int, quantization: KVQuantization | None = None, spare: int = 0) -> int:
    """The slots a row of a RingKVCache holds: the kept first positions, the window and the spare
    slots (keys by channel: in whole blocks, and one block more)."""
    ring = max_size - keep + spare
    if quantization is not None and quantization.keys_by_channel:
        ring = whole_blocks(ring) + CHANNEL_BLOCK
    return keep + ring


class RingKVCache(BatchKVCache):
    """Rows of a batch in bounded memory, as RotatingKVCache keeps one sequence: each row's first
    `keep` positions and its last `max_size - keep` (the window), so the server's rows may run past
    the context. Position p < keep is in slot p, a later one in keep + (p - keep) mod ring: a ring,
    written in place, whose buffers never grow or move. The ring is the window and `spare` slots
    more: a call may feed up to spare + 1 tokens a row (speculative decoding's check of `spare`
    drafts), none of which overwrites a position an earlier query of the call still sees, and
    trimming the rejected ones (cut_rows) leaves every kept position in place.

    Keys by channel take `keep` in whole blocks and a ring of whole blocks with one block more:
    a block of positions then fills a block of slots, and the block a row is filling, stored whole
    (its slots past the row's length filled out), overwrites only positions a ring back, which no
    query of the call sees.
    """

    def __init__(self, max_size: int, keep: int, quantization: KVQuantization | None = None, spare: int = 0):
        check_kv_size(max_size, keep, quantization)
        super().__init__(quantization)
        self.max_size, self.keep, self.window, self.spare = max_size, keep, max_size - keep, spare
        self.slot_count = ring_slots(max_size, keep, quantization, spare)
        self.ring = self.slot_count - keep

    def _slot(self, positions):
        return np.where(positions < self.keep, positions, self.keep + (positions - self.keep) % self.ring)

    def _check_length(self, length: int) -> None:
        if length > self.spare + 1:
            raise ValueError(f"a ring cache with {self.spare} spare slots takes at most {self.spare + 1} tokens"
                             f" a row at a time")

    def mask(self, length: int, window: int = 0) -> mx.array:
        """[batch, 1, length, slots]: for each new token, the kept first positions and the window's
        (a sliding layer's own `window` instead, if any) up to itself, among the positions the slots
        hold once the new ones are in."""
        self._check_length(length)
        query = (self.offset[:, None] + mx.arange(length)[None, :])[:, :, None]  # [rows, length, 1]
        last = (self.offset + length - 1)[:, None, None]
        slot = mx.arange(self.slot_count)[None, None, :]
        # The latest position each slot holds: slot s >= keep holds s, s + ring, s + 2 ring...; a
        # rejected draft's slot reads as the position a ring before it, which no query sees.
        key = mx.where(slot < self.keep, slot, slot + self.ring * ((last - slot) // self.ring))
        seen = (key <= query) & ((slot < self.keep) | (key >= self.keep))  # a ring slot not written yet: none
        seen &= (key > query - window) if window else ((key < self.keep) | (key > query - self.window))
        return seen[:, None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Buffer, Buffer]:
        self._check_length(keys.shape[2])
        return super().update_and_fetch(keys, values)

    def fetched(self, end: int) -> tuple[Buffer, Buffer]:
        return self.keys, self.values

    def add(self, cache: KVCache) -> None:
        """Append a single sequence's cache, of any kind, as a new last row: what of it a later
        query can see, moved to the ring's slots (keys by channel: the whole blocks that hold it)."""
        length = cache.offset
        positions, slots = cache.held()
        wanted = (positions < self.keep) | (positions >= length - self.window)
        key_wanted = wanted
        if self.quantization is not None and self.quantization.keys_by_channel:
            tail = max(self.keep, length - self.window)
            key_wanted = (positions < self.keep) | (positions >= block_start(tail))
        key_positions, key_slots = positions[key_wanted], slots[key_wanted]
        if cache.keys_by_channel and length % CHANNEL_BLOCK:  # the rest of its last block's slots
            rest = whole_blocks(length) - length
            key_positions = np.concatenate([key_positions, length + np.arange(rest)])
            key_slots = np.concatenate([key_slots, key_slots[-1] + 1 + np.arange(rest)])
        keys, values = self._ringed(cache.keys, key_slots, key_positions), self._ringed(cache.values, slots[wanted],
                                                                                     positions[wanted])
        copies = cache.copies
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            if cache.quantized:
                self._quantize()
            elif self.quantized:
                keys, values, copies = self._joined(keys, values, length)
            self.keys = kv_map(lambda a, b: mx.concatenate([a, b]), self.keys, keys)
            self.values = kv_map(lambda a, b: mx.concatenate([a, b]), self.values, values)
        self._add_rows([length], [copies or (None, 0)])

    def _ringed(self, buffer: Buffer, slots: np.ndarray, positions: np.ndarray) -> Buffer:
        """A row of the ring holding a buffer's `slots`, the positions `positions`, in theirs."""
        source, target = mx.array(slots), slot_index(self._slot(positions)[None])

        def ring(a: mx.array) -> mx.array:
            empty = mx.zeros(a.shape[:2] + (self.slot_count,) + a.shape[3:], a.dtype)
            return mx.put_along_axis(empty, target, mx.take(a, source, axis=2), axis=2)

        return kv_map(ring, buffer)

    def extend(self, caches: Sequence[KVCache]) -> None:
        """Append caches as new last rows, each moved to the ring's slots in turn."""
        for cache in caches:
            self.add(cache)

    def make_room(self, new: int) -> None:
        """The ring is always the size it will be."""

    def in_order(self, length: int) -> bool:
        return length <= self.slot_count


def make_batch_cache(windows: list[int], quantization: KVQuantization | None = None, max_size: int = 0,
                     keep: int = 0, spare: int = 0) -> list[BatchKVCache]:
    """One batch cache a layer: growing with the longest row, or with a `max_size` a ring (a
    sliding-window layer's: a ring of its own window, as SlidingKVCache keeps for one sequence),
    with `spare` slots for speculative decoding's drafts."""
    if max_size:
        return [RingKVCache(w, 0, quantization, spare) if w else RingKVCache(max_size, keep, quantization, spare)
                for w in windows]
    return [BatchKVCache(quantization) for _ in windows]
