"""Real-size GGUF files without a download: a published model's exact tensor layout, random valid blocks.

`write("tinyllama.gguf", "tinyllama-1.1b", "Q4_K_M")` writes the tensor names, shapes and types
of TinyLlama-1.1B-Chat-v1.0 in llama.cpp's Q4_K_M mix, with the Llama-2 tokenizer (the one
TinyLlama uses, taken from the bundled demo model). The weights are random bytes whose float16
scale fields are set to small normal values, so every block is valid and activations stay finite:
the file measures speed and memory, not quality. llama.cpp loads it like the real one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.resources import files

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from .errors import MlxLlamaError


@dataclass(frozen=True)
class Shape:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    context: int
    rope_base: float
    rms_eps: float


SHAPES = {
    "tinyllama-1.1b": Shape(n_layers=22, hidden=2048, n_heads=32, n_kv_heads=4, ffn=5632, vocab=32000,
                            context=2048, rope_base=10000.0, rms_eps=1e-5),
}
QUANTS = ("Q4_K_M",)
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15

# Where each type keeps its float16 scales: (byte offset in the block, value).
_SCALE_FIELDS = {
    QT.Q4_K: ((0, 1e-4), (2, 7.5e-4)),  # d, dmin: the min about cancels the mean of d * scale * q
    QT.Q6_K: ((208, 1e-4),),  # d; the int8 sub-block scales are narrowed below
}


def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get Q6_K in a *_K_M mix."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_types(shape: Shape) -> dict[str, tuple[tuple[int, ...], QT]]:
    """name -> (row-major shape, type) of the Q4_K_M file, in llama.cpp's order."""
    head_dim = shape.hidden // shape.n_heads
    kv = shape.n_kv_heads * head_dim
    out = {"token_embd.weight": ((shape.vocab, shape.hidden), QT.Q4_K)}
    for i in range(shape.n_layers):
        more = QT.Q6_K if _use_more_bits(i, shape.n_layers) else QT.Q4_K
        out.update({
            f"blk.{i}.attn_norm.weight": ((shape.hidden,), QT.F32),
            f"blk.{i}.ffn_down.weight": ((shape.hidden, shape.ffn), more),
            f"blk.{i}.ffn_gate.weight": ((shape.ffn, shape.hidden), QT.Q4_K),
            f"blk.{i}.ffn_up.weight": ((shape.ffn, shape.hidden), QT.Q4_K),
            f"blk.{i}.ffn_norm.weight": ((shape.hidden,), QT.F32),
            f"blk.{i}.attn_k.weight": ((kv, shape.hidden), QT.Q4_K),
            f"blk.{i}.attn_output.weight": ((shape.hidden, shape.hidden), QT.Q4_K),
            f"blk.{i}.attn_q.weight": ((shape.hidden, shape.hidden), QT.Q4_K),
            f"blk.{i}.attn_v.weight": ((kv, shape.hidden), more),
        })
    out["output_norm.weight"] = ((shape.hidden,), QT.F32)
    out["output.weight"] = ((shape.vocab, shape.hidden), QT.Q6_K)
    return out


def random_blocks(rng: np.random.Generator, shape: tuple[int, int], qtype: QT) -> np.ndarray:
    """uint8 [rows, row bytes] of random blocks with sane float16 scales."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    data = np.frombuffer(rng.bytes(rows * cols // block * type_size), np.uint8).reshape(-1, type_size).copy()
    for offset, value in _SCALE_FIELDS[qtype]:
        scale = (value * rng.uniform(0.5, 1.5, len(data))).astype(np.float16)
        data[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    if qtype == QT.Q6_K:
        # Sub-block scales in [-32, 32) keep weights near 1e-4 * 32 * 32 at most.
        data[:, 192:208] = data[:, 192:208].view(np.int8) // 4
    return data.reshape(rows, -1)


def write(path: str | os.PathLike, model: str = "tinyllama-1.1b", quant: str = "Q4_K_M", seed: int = 0,
          context: int | None = None) -> None:
    """The file of a published model's layout, with random weights; a `context` other than the
    model's lets benchmarks go deeper than it was trained for (random weights do not care)."""
    if model not in SHAPES:
        raise MlxLlamaError(f"unknown synthetic model {model!r} (known: {', '.join(SHAPES)})")
    if quant not in QUANTS:
        raise MlxLlamaError(f"synthetic {model} is available as {', '.join(QUANTS)}, not {quant!r}")
    shape = SHAPES[model]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(os.fspath(path), "llama")
    writer.add_name(f"synthetic {model} {quant}")
    writer.add_context_length(context or shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.n_layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_rope_dimension_count(shape.hidden // shape.n_heads)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(LLAMA_FTYPE_MOSTLY_Q4_K_M)
    _copy_tokenizer(writer)
    for name, (tensor_shape, qtype) in tensor_types(shape).items():
        if qtype == QT.F32:
            writer.add_tensor(name, np.ones(tensor_shape, np.float32))
        else:
            writer.add_tensor(name, random_blocks(rng, tensor_shape, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _copy_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The Llama-2 SentencePiece vocabulary and chat template of the bundled chat-tiny model."""
    reader = gguf.GGUFReader(str(files("mlxllama.data") / "chat-tiny-Q4_K_M.gguf"))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)
