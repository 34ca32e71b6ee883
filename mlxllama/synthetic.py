"""Real-size GGUF files without a download: a published model's exact tensor layout, random valid blocks.

`write("tinyllama.gguf", "tinyllama-1.1b", "Q4_K_M")` writes the tensor names, shapes and types
of TinyLlama-1.1B-Chat-v1.0 in llama.cpp's Q4_K_M mix, with the Llama-2 tokenizer (the one
TinyLlama uses, taken from the bundled demo model). "qwen3-0.6b" is Qwen3-0.6B's layout (the
`qwen3` architecture: heads of 128 wider than hidden / heads, Q/K norms, the token table tied to
the output and so Q6_K) with that tokenizer padded by unused pieces to Qwen's 151,936: the table
and output product are the real model's size, though its text is not Qwen's. "llama-3-8b" is
Meta-Llama-3-8B's layout (32 layers of 4096, GQA 32/8, FFN 14336, 128,256 tokens padded the same
way), a file of 4.6 GiB for measuring several GPUs. "chat-tiny" is the layout of this project's
chat-tiny fixture (14 MB), for measuring on a CPU at depths its 512 positions do not reach. The weights are
random bytes whose float16 scale fields are set to small normal values, so every block is valid
and activations stay finite: the file measures speed and memory, not quality. llama.cpp loads
it like the real one.
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
    architecture: str = "llama"
    head_dim: int | None = None  # None: hidden / heads
    qk_norm: bool = False
    tied_output: bool = False

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.n_heads


SHAPES = {
    "tinyllama-1.1b": Shape(n_layers=22, hidden=2048, n_heads=32, n_kv_heads=4, ffn=5632, vocab=32000,
                            context=2048, rope_base=10000.0, rms_eps=1e-5),
    "qwen3-0.6b": Shape(n_layers=28, hidden=1024, n_heads=16, n_kv_heads=8, ffn=3072, vocab=151936,
                        context=40960, rope_base=1e6, rms_eps=1e-6, architecture="qwen3", head_dim=128,
                        qk_norm=True, tied_output=True),
    "chat-tiny": Shape(n_layers=6, hidden=256, n_heads=8, n_kv_heads=2, ffn=768, vocab=32000, context=512,
                       rope_base=10000.0, rms_eps=1e-5),
    "llama-3-8b": Shape(n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, ffn=14336, vocab=128256,
                        context=8192, rope_base=500000.0, rms_eps=1e-5),
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
    """name -> (row-major shape, type) of the Q4_K_M file, in llama.cpp's order. A token table
    tied to the output is quantized as the output is (Q6_K)."""
    q, kv = shape.n_heads * shape.head_size, shape.n_kv_heads * shape.head_size
    out = {"token_embd.weight": ((shape.vocab, shape.hidden), QT.Q6_K if shape.tied_output else QT.Q4_K)}
    for i in range(shape.n_layers):
        more = QT.Q6_K if _use_more_bits(i, shape.n_layers) else QT.Q4_K
        out.update({
            f"blk.{i}.attn_norm.weight": ((shape.hidden,), QT.F32),
            f"blk.{i}.ffn_down.weight": ((shape.hidden, shape.ffn), more),
            f"blk.{i}.ffn_gate.weight": ((shape.ffn, shape.hidden), QT.Q4_K),
            f"blk.{i}.ffn_up.weight": ((shape.ffn, shape.hidden), QT.Q4_K),
            f"blk.{i}.ffn_norm.weight": ((shape.hidden,), QT.F32),
            f"blk.{i}.attn_k.weight": ((kv, shape.hidden), QT.Q4_K),
            f"blk.{i}.attn_output.weight": ((shape.hidden, q), QT.Q4_K),
            f"blk.{i}.attn_q.weight": ((q, shape.hidden), QT.Q4_K),
            f"blk.{i}.attn_v.weight": ((kv, shape.hidden), more),
        })
        if shape.qk_norm:
            out[f"blk.{i}.attn_q_norm.weight"] = ((shape.head_size,), QT.F32)
            out[f"blk.{i}.attn_k_norm.weight"] = ((shape.head_size,), QT.F32)
    out["output_norm.weight"] = ((shape.hidden,), QT.F32)
    if not shape.tied_output:
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


def context_for(model: str, positions: int) -> int | None:
    """The context to write a file of `model` for, so that it holds `positions`: None (the model's
    own) where that already does."""
    shape = SHAPES.get(model)
    return positions if shape is not None and positions > shape.context else None


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
    writer = gguf.GGUFWriter(os.fspath(path), shape.architecture)
    writer.add_name(f"synthetic {model} {quant}")
    writer.add_context_length(context or shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.n_layers)
    writer.add_feed_forward_length(shape.ffn)
    if shape.head_dim:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    else:
        writer.add_rope_dimension_count(shape.head_size)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(LLAMA_FTYPE_MOSTLY_Q4_K_M)
    _copy_tokenizer(writer, shape.vocab)
    for name, (tensor_shape, qtype) in tensor_types(shape).items():
        if qtype == QT.F32:
            writer.add_tensor(name, np.ones(tensor_shape, np.float32))
        else:
            writer.add_tensor(name, random_blocks(rng, tensor_shape, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Each padding piece is a unused token (llama_token_type 5): never produced by tokenizing text.
_UNUSED_TOKEN = 5
_PADDING = {"tokenizer.ggml.tokens": lambda i: f"<unused{i}>", "tokenizer.ggml.scores": lambda i: 0.0,
            "tokenizer.ggml.token_type": lambda i: _UNUSED_TOKEN}


def _copy_tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    """The Llama-2 SentencePiece vocabulary and chat template of the bundled chat-tiny model, padded
    with unused pieces to `vocab`."""
    reader = gguf.GGUFReader(str(files("mlxllama.data") / "chat-tiny-Q4_K_M.gguf"))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            value = field.contents()
            if key in _PADDING:
                value = value + [_PADDING[key](i) for i in range(len(value), vocab)]
            writer.add_key_value(key, value, field.types[0], sub_type)
