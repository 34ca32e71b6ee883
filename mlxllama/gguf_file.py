"""Open a GGUF file: its metadata as plain Python values and its tensors, memory-mapped.

The `gguf` package's reader memory-maps the file, so tensor data is read from disk only when a
tensor is converted (weights.py). The header is checked first (gguf_check.py); every problem with
the file surfaces as one MlxLlamaError naming the file. A model split by llama.cpp's gguf-split or
converter (NAME-00001-of-0000N.gguf, ...) opens from its first part: the metadata is the first
part's, the tensors those of every part.
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from .errors import MlxLlamaError
from .gguf_check import HeaderCheck

GGUF_MAGIC = b"GGUF"
# How llama.cpp names the parts of a split model (llama_split_path).
SPLIT_NAME = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf")


@dataclass
class GGUFFile:
    path: str
    reader: GGUFReader
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf ReaderTensor, in file order
    parts: list[str] = field(default_factory=list)  # every file of a split model, the first first


class _Reader(GGUFReader):
    """GGUFReader with a quicker path for metadata arrays, whose sizes the header check has bounded.

    The stock reader makes several numpy memmap views per array item (~40 us and ~1.5 KB each on
    a slow machine), so a few megabytes of hostile arrays would take minutes and gigabytes. Here a
    numeric array is one view and a string two plain-ndarray views, in the stock layout of parts.
    """

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        kind, offs = GGUFValueType(item_type[0]), orig_offs + 12
        parts: list[np.ndarray] = [item_type, count]
        types = [GGUFValueType.ARRAY, kind]
        if kind in self.gguf_scalar_to_np:
            parts.append(self._get(offs, self.gguf_scalar_to_np[kind], count[0]))
            return 12 + int(parts[-1].nbytes), parts, [2], types
        if kind != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        raw = self.data.view(np.ndarray)  # memmap's Python-level __array_finalize__ is the slow part
        for _ in range(int(count[0])):
            length = raw[offs : offs + 8].view("<u8")
            parts += [length, raw[offs + 8 : offs + 8 + int(length[0])]]
            offs += 8 + int(length[0])
        return offs - orig_offs, parts, list(range(3, len(parts), 2)), types


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    first = _open_one(os.fspath(path))
    count = first.metadata.get("split.count", 1)
    return _join_parts(first, count) if isinstance(count, int) and count > 1 else first


def _join_parts(first: GGUFFile, count: int) -> GGUFFile:
    """The model split over `count` files, opened from the first: each part checked to be the
    one its name says, no tensor in two parts, and as many tensors as the first part announces."""
    match = SPLIT_NAME.fullmatch(os.path.basename(first.path))
    if first.metadata.get("split.no", 0) != 0 or not match or int(match.group(2)) != 1 or int(match.group(3)) != count:
        raise MlxLlamaError(f"{first.path}: part {first.metadata.get('split.no', 0) + 1} of a model split in {count};"
                            f" open its first part, NAME-00001-of-{count:05d}.gguf")
    tensors, parts = dict(first.tensors), [first.path]
    for number in range(2, count + 1):
        part_path = os.path.join(os.path.dirname(first.path), f"{match.group(1)}-{number:05d}-of-{count:05d}.gguf")
        if not os.path.isfile(part_path):
            raise MlxLlamaError(f"{first.path}: part {number} of {count} is missing ({part_path})")
        part = _open_one(part_path)
        if part.metadata.get("split.no") != number - 1 or part.metadata.get("split.count") != count:
            raise MlxLlamaError(f"{part_path}: not part {number} of {count} (its split.no and split.count say otherwise)")
        twice = sorted(tensors.keys() & part.tensors.keys())
        if twice:
            raise MlxLlamaError(f"{part_path}: tensor {twice[0]!r} is in an earlier part too")
        tensors.update(part.tensors)
        parts.append(part_path)
    announced = first.metadata.get("split.tensors.count", len(tensors))
    if announced != len(tensors):
        raise MlxLlamaError(f"{first.path}: the {count} parts hold {len(tensors)} tensors, split.tensors.count says {announced}")
    return GGUFFile(first.path, first.reader, first.metadata, tensors, parts)


def _open_one(path: str) -> GGUFFile:
    if not os.path.isfile(path):
        raise MlxLlamaError(f"{path}: {'is a directory, not a GGUF file' if os.path.isdir(path) else 'no such file'}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if not magic:
                raise MlxLlamaError(f"{path}: not a GGUF file (the file is empty)")
            if magic != GGUF_MAGIC:
                raise MlxLlamaError(f"{path}: not a GGUF file (offset 0: expected magic b'GGUF', found {magic!r})")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                HeaderCheck(path, buf).run()
    except OSError as e:
        raise MlxLlamaError(f"{path}: cannot read the file ({e.strerror or e})") from None
    # The check above bounds every count, length and offset the reader will use; anything it
    # still rejects is reported the same way rather than escaping as a stray exception type.
    try:
        reader = _Reader(path, "r")
        metadata = {k: _field_value(f) for k, f in reader.fields.items()}
    except Exception as e:
        raise MlxLlamaError(f"{path}: corrupt GGUF ({type(e).__name__}: {_one_line(e)})") from None
    return GGUFFile(path, reader, metadata, {t.name: t for t in reader.tensors}, [path])


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    return open_gguf(path).metadata


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or "no detail"


def _field_value(field) -> Any:
    """Strings as str, numeric arrays as numpy arrays, string arrays as list[str], scalars as Python values."""
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if not field.data:
            return np.zeros(0)
        return np.concatenate([field.parts[i] for i in field.data])
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]][0].item()


def tensor_shape(tensor) -> tuple[int, ...]:
    """Row-major shape: GGUF lists ne[0], the contiguous axis, first."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))
