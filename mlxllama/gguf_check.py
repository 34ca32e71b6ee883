"""The hostile-file check: a bounded walk over a GGUF header before the `gguf` package's reader trusts it.

Every count, length, type and offset in the header is checked against the bytes the file holds,
so a truncated or crafted file is reported as one line naming the file, the offset and what is
wrong, never as a stray exception, a huge allocation or minutes of work.
"""

from __future__ import annotations

import math
import mmap
import struct

from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from .errors import MlxLlamaError

# GGUFReader does pure-Python work for every metadata key, string-array item and tensor (about
# 1 to 100 us each), so a hostile file of many tiny entries could keep it busy for minutes. These
# limits cap that at a few seconds and sit far above real models (~50 keys, tokenizers of ~300k
# tokens plus as many merges, ~1,200 tensors for a 405B llama).
MAX_KEYS = 1 << 14
MAX_TENSORS = 1 << 14
MAX_STRING_ITEMS = 1 << 21
GGML_MAX_DIMS = 4
_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}


class HeaderCheck:
    """A bounded walk over the header that checks every length against the bytes left in the
    file before GGUFReader trusts it; it builds nothing, so it allocates nothing of note."""

    def __init__(self, path: str, buf: mmap.mmap):
        self.path, self.buf, self.size, self.pos = path, buf, len(buf), 0

    def fail(self, problem: str, offset: int) -> MlxLlamaError:
        return MlxLlamaError(f"{self.path}: {problem} (offset {offset})")

    def take(self, n: int, what: str) -> int:
        """Consume n bytes; the offset they start at."""
        start = self.pos
        if n > self.size - start:
            raise self.fail(
                f"truncated or corrupt GGUF header: {what} would need {n} bytes but only {self.size - start} remain",
                start,
            )
        self.pos += n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

    def skip_string(self, what: str) -> None:
        self.take(self.u64(f"length of {what}"), what)

    def name(self, what: str) -> str:
        at = self.pos
        self.skip_string(what)
        raw = self.buf[at + 8 : self.pos]
        try:
            return raw.decode("utf-8")  # strict, as GGUFReader decodes names
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8: {raw[:40]!r}", at) from None

    def run(self) -> None:
        self.take(4, "magic")  # already checked by the caller
        version = self.u32("version")
        if version not in (2, 3):
            if version & 0xFFFF == 0 and version >> 24 in (2, 3):
                raise self.fail("big-endian GGUF files are not supported", 4)
            raise self.fail(f"unsupported GGUF version {version} (supported: 2, 3)", 4)
        n_tensors, n_keys = self.u64("tensor count"), self.u64("metadata key count")
        # Even an empty key or name needs 13 (key, type, 1-byte value) or 24 bytes (name, dim
        # count, type, offset), so larger counts cannot fit; the limits keep the reader quick.
        for count, what, offset, min_size, limit in (
            (n_tensors, "tensor count", 8, 24, MAX_TENSORS),
            (n_keys, "metadata key count", 16, 13, MAX_KEYS),
        ):
            if count > (self.size - 24) // min_size:
                raise self.fail(
                    f"{what} {count} is impossible in a file of {self.size} bytes (truncated or corrupt)", offset
                )
            if count > limit:
                raise self.fail(f"{what} {count} is over this loader's limit of {limit}", offset)
        alignment = self.metadata(n_keys)
        infos = {}
        for i in range(n_tensors):
            at = self.pos
            name, *info = self.tensor_info(i)
            if name in infos:
                raise self.fail(f"tensor {name!r} appears twice", at)
            infos[name] = (*info, at)
        data_start = -(-self.pos // alignment) * alignment
        for name, (dims, qtype, offset, at) in infos.items():
            self.check_tensor_data(name, dims, qtype, offset, at, data_start, alignment)

    def metadata(self, n_keys: int) -> int:
        """Walk the key/value pairs; the tensor data alignment."""
        # GGUFReader files the header counts under these names, so a key may not reuse them.
        keys, alignment, string_items = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}, 32, 0
        for i in range(n_keys):
            at = self.pos
            key = self.name(f"key of metadata entry {i}")
            if key in keys:
                raise self.fail(f"metadata key {key!r} appears twice or is reserved", at)
            keys.add(key)
            type_at = self.pos
            vtype = self.u32(f"value type of {key!r}")
            if vtype == GGUFValueType.ARRAY:
                item_type = self.u32(f"item type of {key!r}")
                count_at = self.pos
                count = self.u64(f"item count of {key!r}")
                if item_type == GGUFValueType.STRING:
                    # Each string needs at least its 8-byte length: reject absurd counts before looping.
                    if count > (self.size - self.pos) // 8:
                        self.take(8 * count, f"{count} strings of {key!r}")
                    string_items += count
                    if string_items > MAX_STRING_ITEMS:
                        raise self.fail(
                            f"metadata string arrays hold more than this loader's limit of {MAX_STRING_ITEMS} items"
                            f" (at {key!r})", count_at)
                    for j in range(count):
                        self.skip_string(f"item {j} of {key!r}")
                elif item_type in _SCALAR_SIZES:
                    self.take(count * _SCALAR_SIZES[item_type], f"{count} items of {key!r}")
                elif item_type == GGUFValueType.ARRAY:
                    raise self.fail(f"metadata key {key!r} is an array of arrays, which is not supported", type_at + 4)
                else:
                    raise self.fail(f"metadata key {key!r} has unknown array item type {item_type}", type_at + 4)
            elif vtype == GGUFValueType.STRING:
                self.skip_string(f"value of {key!r}")
            elif vtype in _SCALAR_SIZES:
                value_at = self.take(_SCALAR_SIZES[vtype], f"value of {key!r}")
                if key == "general.alignment":
                    # GGUFReader insists on uint32 here; the data start is rounded up to it.
                    alignment = struct.unpack_from("<I", self.buf, value_at)[0] if vtype == GGUFValueType.UINT32 else 0
                    if alignment == 0 or alignment & (alignment - 1):
                        raise self.fail("general.alignment must be a uint32 power of two", value_at)
            else:
                raise self.fail(f"metadata key {key!r} has unknown value type {vtype}", type_at)
        return alignment

    def tensor_info(self, i: int):
        name = self.name(f"name of tensor {i}")
        n_dims = self.u32(f"dimension count of tensor {name!r}")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise self.fail(f"tensor {name!r} has {n_dims} dimensions, not 1 to {GGML_MAX_DIMS}", self.pos - 4)
        dims = [self.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
        type_id = self.u32(f"type of tensor {name!r}")
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise self.fail(f"tensor {name!r} has unknown GGML type id {type_id}", self.pos - 4) from None
        offset = self.u64(f"data offset of tensor {name!r}")
        return name, dims, qtype, offset

    def check_tensor_data(self, name, dims, qtype, offset, at, data_start, alignment) -> None:
        block, type_size = GGML_QUANT_SIZES[qtype]
        if 0 in dims:
            raise self.fail(f"tensor {name!r} has a zero dimension {dims}", at)
        if (dims[0] if dims else 1) % block:
            raise self.fail(
                f"tensor {name!r} row length {dims[0] if dims else 1} is not a multiple of the"
                f" {qtype.name} block ({block})", at)
        if offset % alignment:
            raise self.fail(f"tensor {name!r} data offset {offset} is not a multiple of the alignment {alignment}", at)
        # Python integers: a product that would wrap around in numpy's uint64 is simply too big here.
        end = data_start + offset + math.prod(dims) // block * type_size
        if end > self.size:
            raise MlxLlamaError(
                f"{self.path}: tensor {name!r} data ends at offset {end}, past the end of the file ({self.size} bytes);"
                " the file is truncated"
            )
