"""Read a GGUF file: metadata into plain Python values, the model config, tensors into MLX arrays.

The `gguf` package's reader memory-maps the file, so tensors are read from disk only when
converted. Every problem with the file surfaces as one MlxLlamaError naming the file.
"""

from __future__ import annotations

import os
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
SUPPORTED_ARCHITECTURES = ("llama",)
# Architectures whose converter permutes Q/K so that RoPE rotates adjacent pairs.
ADJACENT_PAIR_ROPE = ("llama",)


@dataclass
class GGUFFile:
    path: str
    reader: GGUFReader
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf ReaderTensor, in file order


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise MlxLlamaError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise MlxLlamaError(f"{path}: not a GGUF file (offset 0: expected magic b'GGUF', found {magic!r})")
    try:
        reader = GGUFReader(path, "r")
    except MlxLlamaError:
        raise
    except Exception as e:  # the reader signals truncation and bad counts with assorted exceptions
        raise MlxLlamaError(f"{path}: corrupt or truncated GGUF ({type(e).__name__}: {_one_line(e)})") from None
    file_size = os.path.getsize(path)
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > file_size:
            raise MlxLlamaError(
                f"{path}: tensor '{t.name}' data ends at offset {end}, past the end of the file ({file_size} bytes);"
                " the file is truncated"
            )
    metadata = {k: _field_value(f) for k, f in reader.fields.items()}
    return GGUFFile(path, reader, metadata, {t.name: t for t in reader.tensors})


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


def read_config(gguf: GGUFFile) -> ModelConfig:
    meta = gguf.metadata

    def need(key: str):
        if key not in meta:
            raise MlxLlamaError(f"{gguf.path}: missing metadata key '{key}'")
        return meta[key]

    arch = need("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise MlxLlamaError(
            f"{gguf.path}: unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    hidden = int(need(f"{arch}.embedding_length"))
    n_heads = int(need(f"{arch}.attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // n_heads))
    tensors = gguf.tensors
    if "token_embd.weight" not in tensors:
        raise MlxLlamaError(f"{gguf.path}: missing tensor 'token_embd.weight'")
    if "rope_freqs.weight" in tensors:
        raise MlxLlamaError(f"{gguf.path}: per-dimension RoPE frequencies (rope_freqs.weight) are not supported yet")
    vocab_size = int(meta.get(f"{arch}.vocab_size", tensors["token_embd.weight"].shape[1]))
    return ModelConfig(
        architecture=arch,
        n_layers=int(need(f"{arch}.block_count")),
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rope_dim=int(meta.get(f"{arch}.rope.dimension_count", head_dim)),
        ffn_size=int(need(f"{arch}.feed_forward_length")),
        rope_base=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scale=_rope_scale(gguf, arch),
        rope_traditional=arch in ADJACENT_PAIR_ROPE,
        rms_eps=float(need(f"{arch}.attention.layer_norm_rms_epsilon")),
        context_length=int(need(f"{arch}.context_length")),
        vocab_size=vocab_size,
        tied_output="output.weight" not in tensors,
    )


def _rope_scale(gguf: GGUFFile, arch: str) -> float:
    meta = gguf.metadata
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", ""):
        # Older converters wrote only the linear factor.
        factor = float(meta.get(f"{arch}.rope.scale_linear", 1.0))
        return 1.0 / factor
    if kind == "linear":
        return 1.0 / float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    raise MlxLlamaError(f"{gguf.path}: unsupported RoPE scaling type '{kind}' (supported: none, linear)")


def tensor_shape(tensor) -> tuple[int, ...]:
    """Row-major shape: GGUF lists ne[0], the contiguous axis, first."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def _to_mlx(gguf: GGUFFile, tensor, dtype: mx.Dtype) -> mx.array:
    qtype = tensor.tensor_type
    if qtype not in SUPPORTED_TYPES:
        type_name = qtype.name if isinstance(qtype, GGMLQuantizationType) else str(qtype)
        raise MlxLlamaError(f"{gguf.path}: tensor '{tensor.name}' has unsupported type {type_name}")
    shape = tensor_shape(tensor)
    block, _ = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise MlxLlamaError(
            f"{gguf.path}: tensor '{tensor.name}' row length {shape[-1]} is not a multiple of the {qtype.name} block ({block})"
        )
    return dequantize(tensor.data, qtype, shape).astype(dtype)


def load_weights(gguf: GGUFFile, config: ModelConfig, dtype: mx.Dtype = mx.float16) -> dict[str, mx.array]:
    """All tensors the model needs, under their GGUF names; norms stay float32 (they are tiny).

    Shapes are checked against the metadata from the tensor headers, before any data is read.
    """
    tensors = gguf.tensors
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name not in tensors:
            raise MlxLlamaError(f"{gguf.path}: missing tensor '{name}'")
        found = tensor_shape(tensors[name])
        if found != shape:
            raise MlxLlamaError(f"{gguf.path}: tensor '{name}' has shape {found}, expected {shape} from the metadata")
        weights[name] = _to_mlx(gguf, tensors[name], mx.float32 if len(shape) == 1 else dtype)
    return weights


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, q_dim, kv_dim = config.hidden_size, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    shapes = {"token_embd.weight": (config.vocab_size, hidden), "output_norm.weight": (hidden,)}
    if not config.tied_output:
        shapes["output.weight"] = (config.vocab_size, hidden)
    for i in range(config.n_layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (q_dim, hidden),
            f"blk.{i}.attn_k.weight": (kv_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, q_dim),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.ffn_gate.weight": (config.ffn_size, hidden),
            f"blk.{i}.ffn_up.weight": (config.ffn_size, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, config.ffn_size),
        })
    return shapes
