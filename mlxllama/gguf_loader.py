"""Read a GGUF file: metadata into plain Python values, the model config, tensors into MLX arrays.

The `gguf` package's reader memory-maps the file, so tensors are read from disk only when
converted. Every problem with the file surfaces as one MlxLlamaError naming the file.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from .config import ModelConfig
from .errors import MlxLlamaError
from .quants import SUPPORTED_TYPES, dequantize

GGUF_MAGIC = b"GGUF"
# `llama` covers Llama 1/2/3 and Mistral; all of these are the same pre-norm decoder with SwiGLU.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "phi3")
# Architectures whose converter permutes Q/K so that RoPE rotates adjacent pairs.
ADJACENT_PAIR_ROPE = ("llama",)
# Per-pair RoPE frequency divisors: Llama 3's rope_freqs, else one of Phi-3's LongRoPE sets, which
# llama.cpp picks by context size (see long_rope_factors).
ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS_SHORT, ROPE_FACTORS_LONG = "rope_factors_short.weight", "rope_factors_long.weight"
# llama.cpp rounds the context size up to a multiple of this before anything uses it.
LLAMA_CPP_CONTEXT_PAD = 256

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


@dataclass
class GGUFFile:
    path: str
    reader: GGUFReader
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf ReaderTensor, in file order


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
    path = os.fspath(path)
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
                _HeaderCheck(path, buf).run()
    except OSError as e:
        raise MlxLlamaError(f"{path}: cannot read the file ({e.strerror or e})") from None
    # The check above bounds every count, length and offset the reader will use; anything it
    # still rejects is reported the same way rather than escaping as a stray exception type.
    try:
        reader = _Reader(path, "r")
        metadata = {k: _field_value(f) for k, f in reader.fields.items()}
    except Exception as e:
        raise MlxLlamaError(f"{path}: corrupt GGUF ({type(e).__name__}: {_one_line(e)})") from None
    return GGUFFile(path, reader, metadata, {t.name: t for t in reader.tensors})


class _HeaderCheck:
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


def read_config(gguf: GGUFFile, context_length: int | None = None) -> ModelConfig:
    """The model config for a context of `context_length` tokens (None: the model's trained context,
    llama.cpp's default), checked against the tensor headers so that building the model from it
    allocates no more than the file's tensors hold."""
    meta, path = gguf.metadata, gguf.path

    def get(key: str, kind: type, default=None):
        """meta[key], which must be a `kind` (str, int or float); default when absent, None: required."""
        if key not in meta:
            if default is None:
                raise MlxLlamaError(f"{path}: missing metadata key {key!r}")
            return default
        value = meta[key]
        ok = isinstance(value, str) if kind is str else (
            isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
        )
        if not ok:
            raise MlxLlamaError(
                f"{path}: metadata key {key!r} should be {_KIND_NAMES[kind]}, found {_describe(value)}"
            )
        return value

    def positive(key: str, kind: type, default=None):
        value = get(key, kind, default)
        if not (0 < value < math.inf):
            raise MlxLlamaError(f"{path}: metadata key {key!r} should be positive, found {value}")
        return value

    arch = get("general.architecture", str)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise MlxLlamaError(
            f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    hidden = positive(f"{arch}.embedding_length", int)
    n_heads = positive(f"{arch}.attention.head_count", int)
    n_kv_heads = positive(f"{arch}.attention.head_count_kv", int, n_heads)
    if n_heads % n_kv_heads:
        raise MlxLlamaError(
            f"{path}: {arch}.attention.head_count {n_heads} is not a multiple of"
            f" {arch}.attention.head_count_kv {n_kv_heads}"
        )
    head_dim = positive(f"{arch}.attention.key_length", int, max(hidden // n_heads, 1))
    rope_dim = positive(f"{arch}.rope.dimension_count", int, head_dim)
    if rope_dim > head_dim or rope_dim % 2:
        raise MlxLlamaError(
            f"{path}: {arch}.rope.dimension_count {rope_dim} should be even and at most the head size {head_dim}"
        )
    n_layers = positive(f"{arch}.block_count", int)
    tensors = gguf.tensors
    if n_layers > len(tensors):  # before expected_shapes() makes an entry for every layer
        raise MlxLlamaError(
            f"{path}: {arch}.block_count {n_layers} is more than the file's {len(tensors)} tensors can hold"
        )
    if "token_embd.weight" not in tensors:
        raise MlxLlamaError(f"{path}: missing tensor 'token_embd.weight'")
    trained_context = positive(f"{arch}.context_length", int)
    if context_length is None:
        context_length = trained_context
    elif not 1 <= context_length <= trained_context:
        raise MlxLlamaError(f"context length {context_length} is not between 1 and the model's trained context"
                            f" of {trained_context}")
    long_factors = long_rope_factors(
        context_length, positive(f"{arch}.rope.scaling.original_context_length", int, trained_context))
    config = ModelConfig(
        architecture=arch,
        n_layers=n_layers,
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        ffn_size=positive(f"{arch}.feed_forward_length", int),
        rope_base=float(positive(f"{arch}.rope.freq_base", float, 10000.0)),
        rope_scale=_rope_scale(gguf, arch, get, positive),
        rope_traditional=arch in ADJACENT_PAIR_ROPE,
        rms_eps=float(positive(f"{arch}.attention.layer_norm_rms_epsilon", float)),
        context_length=context_length,
        vocab_size=positive(f"{arch}.vocab_size", int, tensor_shape(tensors["token_embd.weight"])[0]),
        tied_output="output.weight" not in tensors,
        rope_freq_factors=_rope_freq_factors(gguf, rope_dim, long_factors),
        rope_attn_factor=float(positive(f"{arch}.rope.scaling.attn_factor", float, 1.0)),
        attn_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        fused_qkv="blk.0.attn_qkv.weight" in tensors,
        # llama.cpp's phi3 always reads gate and up as one ffn_up of twice the FFN width.
        fused_gate_up=arch == "phi3",
    )
    check_shapes(gguf, config)
    return config


def long_rope_factors(context_length: int, original_context_length: int) -> bool:
    """Whether llama.cpp's get_rope_factors takes the long LongRoPE factors: when its per-sequence
    context, rounded up to a multiple of 256, exceeds rope.scaling.original_context_length."""
    padded = -(-context_length // LLAMA_CPP_CONTEXT_PAD) * LLAMA_CPP_CONTEXT_PAD
    return padded > original_context_length


def _rope_freq_factors(gguf: GGUFFile, rope_dim: int, long_factors: bool) -> tuple[float, ...] | None:
    # As llama.cpp: rope_freqs wins; a missing LongRoPE set means plain RoPE, even if the other exists.
    name = ROPE_FREQS if ROPE_FREQS in gguf.tensors else ROPE_FACTORS_LONG if long_factors else ROPE_FACTORS_SHORT
    if name not in gguf.tensors:
        return None
    tensor = gguf.tensors[name]
    if tensor_shape(tensor) != (rope_dim // 2,):
        raise MlxLlamaError(
            f"{gguf.path}: tensor {name!r} has shape {tensor_shape(tensor)}, expected {(rope_dim // 2,)} from the metadata")
    factors = np.array(tensor_to_mlx(gguf, tensor, mx.float32), dtype=np.float64)
    if not np.all((factors > 0) & np.isfinite(factors)):
        raise MlxLlamaError(f"{gguf.path}: tensor {name!r} should hold positive RoPE frequency factors")
    return tuple(factors.tolist())


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    if isinstance(value, (list, np.ndarray)):
        return f"an array of {len(value)} items"
    return f"{type(value).__name__} {value!r}"


def _rope_scale(gguf: GGUFFile, arch: str, get, positive) -> float:
    kind = get(f"{arch}.rope.scaling.type", str, "none")
    if kind in ("none", ""):
        # Older converters wrote only the linear factor.
        return 1.0 / positive(f"{arch}.rope.scale_linear", float, 1.0)
    if kind == "linear":
        return 1.0 / positive(f"{arch}.rope.scaling.factor", float, 1.0)
    raise MlxLlamaError(f"{gguf.path}: unsupported RoPE scaling type {kind!r} (supported: none, linear)")


def tensor_shape(tensor) -> tuple[int, ...]:
    """Row-major shape: GGUF lists ne[0], the contiguous axis, first."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def tensor_to_mlx(gguf: GGUFFile, tensor, dtype: mx.Dtype) -> mx.array:
    qtype = tensor.tensor_type
    if qtype not in SUPPORTED_TYPES:
        type_name = qtype.name if isinstance(qtype, GGMLQuantizationType) else str(qtype)
        raise MlxLlamaError(f"{gguf.path}: tensor {tensor.name!r} has unsupported type {type_name}")
    shape = tensor_shape(tensor)
    block, _ = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise MlxLlamaError(
            f"{gguf.path}: tensor {tensor.name!r} row length {shape[-1]} is not a multiple of the {qtype.name} block ({block})"
        )
    return dequantize(tensor.data, qtype, shape).astype(dtype)


def weight_dtype(name: str, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.Dtype:
    """Norm weights stay float32 (they are tiny and scale every activation); the rest take dtype."""
    return mx.float32 if len(shape) == 1 and not name.endswith(".bias") else dtype


def load_weights(gguf: GGUFFile, config: ModelConfig, dtype: mx.Dtype = mx.float16) -> dict[str, mx.array]:
    """All tensors the model needs, under their GGUF names; norms stay float32 (they are tiny).

    config is read_config(gguf)'s, which has checked every one of these tensors' shapes.
    """
    weights = {}
    for name, shape in expected_shapes(config).items():
        array = tensor_to_mlx(gguf, gguf.tensors[name], weight_dtype(name, shape, dtype))
        weights.update(split_fused(name, array, config))
    return weights


def split_fused(name: str, array: mx.array, config: ModelConfig) -> dict[str, mx.array]:
    """A fused tensor (rows [q; k; v] or [gate; up]) as the separate tensors the model has; others as they are."""
    block, part, kind = (None, *name.rsplit(".", 1)) if name.count(".") < 2 else name.rsplit(".", 2)
    if part == "attn_qkv":
        q_dim, kv_dim = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        q, k, v = mx.split(array, [q_dim, q_dim + kv_dim])
        return {f"{block}.attn_q.{kind}": q, f"{block}.attn_k.{kind}": k, f"{block}.attn_v.{kind}": v}
    if part == "ffn_up" and config.fused_gate_up:
        gate, up = mx.split(array, 2)
        return {f"{block}.ffn_gate.{kind}": gate, f"{block}.ffn_up.{kind}": up}
    return {name: array}


def check_shapes(gguf: GGUFFile, config: ModelConfig) -> None:
    """Every tensor of expected_shapes(config) must be in the file with that shape."""
    tensors = gguf.tensors
    for name, shape in expected_shapes(config).items():
        if name not in tensors:
            raise MlxLlamaError(f"{gguf.path}: missing tensor {name!r}")
        found = tensor_shape(tensors[name])
        if found != shape:
            raise MlxLlamaError(f"{gguf.path}: tensor {name!r} has shape {found}, expected {shape} from the metadata")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, q_dim, kv_dim = config.hidden_size, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    shapes = {"token_embd.weight": (config.vocab_size, hidden), "output_norm.weight": (hidden,)}
    if not config.tied_output:
        shapes["output.weight"] = (config.vocab_size, hidden)
    projections = {"attn_qkv": q_dim + 2 * kv_dim} if config.fused_qkv else {
        "attn_q": q_dim, "attn_k": kv_dim, "attn_v": kv_dim}
    for i in range(config.n_layers):
        for proj, rows in projections.items():
            shapes[f"blk.{i}.{proj}.weight"] = (rows, hidden)
            if config.attn_bias:
                shapes[f"blk.{i}.{proj}.bias"] = (rows,)
        shapes.update({
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.attn_output.weight": (hidden, q_dim),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.ffn_down.weight": (hidden, config.ffn_size),
        })
        if config.fused_gate_up:
            shapes[f"blk.{i}.ffn_up.weight"] = (2 * config.ffn_size, hidden)
        else:
            shapes[f"blk.{i}.ffn_gate.weight"] = (config.ffn_size, hidden)
            shapes[f"blk.{i}.ffn_up.weight"] = (config.ffn_size, hidden)
    return shapes
