"""Model hyper-parameters, and how they are read from a GGUF file's metadata.

The keys every architecture shares (`{arch}.embedding_length`, `.attention.head_count`…) are read
here; what sets a family apart comes from its Architecture (architecture.py). The config is checked
against the file's tensor headers, so building the model from it allocates no more than the file holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from ..errors import MlxLlamaError
from ..gguf_file import GGUFFile, tensor_shape
from ..tensors import tensor_to_mlx

if TYPE_CHECKING:
    from .architecture import Architecture

# Per-pair RoPE frequency divisors: Llama 3's rope_freqs, else one of Phi-3's LongRoPE sets, which
# llama.cpp picks by context size (see long_rope_factors).
ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS_SHORT, ROPE_FACTORS_LONG = "rope_factors_short.weight", "rope_factors_long.weight"
# llama.cpp rounds the context size up to a multiple of this before anything uses it.
LLAMA_CPP_CONTEXT_PAD = 256


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    ffn_size: int
    rope_base: float
    # RoPE position scale (1 / linear scaling factor), 1.0 when the file asks for none.
    rope_scale: float
    # True: rotate adjacent pairs (llama.cpp's permuted Q/K for `llama`); False: NeoX half-split.
    rope_traditional: bool
    rms_eps: float
    # The context chosen at load (at most the trained one): prompts and generation must fit in it.
    context_length: int
    vocab_size: int
    tied_output: bool
    # Per-pair RoPE frequency divisors (llama.cpp's freq_factors: Llama 3's rope_freqs, Phi-3's
    # short or long factors, picked by context_length; times YaRN's, see yarn_factors), rope_dim / 2
    # of them; None: plain RoPE.
    rope_freq_factors: tuple[float, ...] | None = None
    # Scale of the rotated Q/K dims after RoPE (rope.scaling.attn_factor: Phi-3's LongRoPE, which
    # llama.cpp applies with the short factors as well as the long ones; times YaRN's scale).
    rope_attn_factor: float = 1.0
    # Q/K/V projections with biases (Qwen2).
    attn_bias: bool = False
    # The file stores Q/K/V as one attn_qkv tensor, and gate/up as one ffn_up tensor of twice the
    # FFN width (Phi-3); the model then holds them as the fused layers attn_qkv and ffn_gate_up.
    fused_qkv: bool = False
    fused_gate_up: bool = False
    # Per-head RMSNorm of Q and K before RoPE (Qwen3, Gemma 3: attn_q_norm, attn_k_norm).
    qk_norm: bool = False
    # RMSNorm of the attention's and the FFN's outputs before each residual add (Gemma 3:
    # post_attention_norm, post_ffw_norm).
    post_norms: bool = False
    # The gated FFN's activation: "silu" (SwiGLU) or "gelu" (GeGLU, GELU's tanh approximation).
    ffn_activation: str = "silu"
    # What the token embeddings are multiplied by (Gemma: sqrt(hidden_size)).
    embedding_scale: float = 1.0
    # Q's scale in attention; None: 1 / sqrt(head_dim).
    attention_scale: float | None = None
    # Logits soft-capped as cap * tanh(logits / cap) (0: not capped).
    final_logit_softcap: float = 0.0
    # Sliding-window attention (Gemma 3): a query in a sliding layer sees itself and the window - 1
    # positions before it; sliding_layers[i] says whether layer i is one, whose RoPE base is
    # rope_base_local (with no position scaling) instead of rope_base.
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()
    rope_base_local: float = 10000.0
    # Mixture of experts (Qwen3-MoE, Mixtral): each block's FFN is n_experts gated FFNs of
    # expert_ffn_size, of which a softmax router picks n_experts_used a token, their weights
    # renormalized to sum to 1 (0: a dense FFN).
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_size: int = 0

    def window(self, layer: int) -> int:
        """Layer `layer`'s attention window; 0: it sees every earlier position."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else 0


class Metadata:
    """Typed access to a GGUF file's metadata keys, each problem reported as one line naming the file and key."""

    def __init__(self, gguf: GGUFFile):
        self.meta, self.path = gguf.metadata, gguf.path

    def get(self, key: str, kind: type, default: Any = None) -> Any:
        """meta[key], which must be a `kind` (str, int or float); default when absent, None: required."""
        if key not in self.meta:
            if default is None:
                raise MlxLlamaError(f"{self.path}: missing metadata key {key!r}")
            return default
        value = self.meta[key]
        ok = isinstance(value, str) if kind is str else (
            isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
        )
        if not ok:
            raise MlxLlamaError(
                f"{self.path}: metadata key {key!r} should be {_KIND_NAMES[kind]}, found {_describe(value)}")
        return value

    def positive(self, key: str, kind: type, default: Any = None) -> Any:
        value = self.get(key, kind, default)
        if not (0 < value < math.inf):
            raise MlxLlamaError(f"{self.path}: metadata key {key!r} should be positive, found {value}")
        return value


def read_config(gguf: GGUFFile, architecture: Architecture, context_length: int | None = None) -> ModelConfig:
    """The model config for a context of `context_length` tokens (None: the model's trained context,
    llama.cpp's default), checked against the tensor headers."""
    keys, path, arch = Metadata(gguf), gguf.path, architecture.name
    hidden = keys.positive(f"{arch}.embedding_length", int)
    n_heads = keys.positive(f"{arch}.attention.head_count", int)
    n_kv_heads = keys.positive(f"{arch}.attention.head_count_kv", int, n_heads)
    if n_heads % n_kv_heads:
        raise MlxLlamaError(
            f"{path}: {arch}.attention.head_count {n_heads} is not a multiple of"
            f" {arch}.attention.head_count_kv {n_kv_heads}")
    head_dim = keys.positive(f"{arch}.attention.key_length", int, max(hidden // n_heads, 1))
    rope_dim = keys.positive(f"{arch}.rope.dimension_count", int, head_dim)
    if rope_dim > head_dim or rope_dim % 2:
        raise MlxLlamaError(
            f"{path}: {arch}.rope.dimension_count {rope_dim} should be even and at most the head size {head_dim}")
    n_layers = keys.positive(f"{arch}.block_count", int)
    tensors = gguf.tensors
    if n_layers > len(tensors):  # before the tensor table makes an entry for every layer
        raise MlxLlamaError(
            f"{path}: {arch}.block_count {n_layers} is more than the file's {len(tensors)} tensors can hold")
    if "token_embd.weight" not in tensors:
        raise MlxLlamaError(f"{path}: missing tensor 'token_embd.weight'")
    trained_context = keys.positive(f"{arch}.context_length", int)
    if context_length is None:
        context_length = trained_context
    elif not 1 <= context_length <= trained_context:
        raise MlxLlamaError(f"context length {context_length} is not between 1 and the model's trained context"
                            f" of {trained_context}")
    original_context = keys.positive(f"{arch}.rope.scaling.original_context_length", int, trained_context)
    long_factors = long_rope_factors(context_length, original_context)
    rope_base = float(keys.positive(f"{arch}.rope.freq_base", float, 10000.0))
    freq_factors = _rope_freq_factors(gguf, rope_dim, long_factors)
    attn_factor = float(keys.positive(f"{arch}.rope.scaling.attn_factor", float, 1.0))
    if keys.get(f"{arch}.rope.scaling.type", str, "none") == "yarn":
        yarn, mscale = yarn_factors(keys.positive(f"{arch}.rope.scaling.factor", float), rope_dim, rope_base,
                                    original_context, float(keys.get(f"{arch}.rope.scaling.yarn_log_multiplier", float, 0.0)))
        freq_factors = tuple(f * y for f, y in zip(freq_factors or (1.0,) * len(yarn), yarn))
        attn_factor *= mscale
    config = ModelConfig(
        architecture=arch,
        n_layers=n_layers,
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        ffn_size=keys.positive(f"{arch}.feed_forward_length", int),
        rope_base=rope_base,
        rope_scale=_rope_scale(keys, arch),
        rope_traditional=architecture.rope_traditional,
        rms_eps=float(keys.positive(f"{arch}.attention.layer_norm_rms_epsilon", float)),
        context_length=context_length,
        vocab_size=keys.positive(f"{arch}.vocab_size", int, tensor_shape(tensors["token_embd.weight"])[0]),
        tied_output="output.weight" not in tensors,
        rope_freq_factors=freq_factors,
        rope_attn_factor=attn_factor,
        attn_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        fused_qkv="blk.0.attn_qkv.weight" in tensors,
        fused_gate_up=architecture.fused_gate_up,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        post_norms="blk.0.post_attention_norm.weight" in tensors,
    )
    n_experts = keys.get(f"{arch}.expert_count", int, 0)
    if n_experts:
        used = keys.positive(f"{arch}.expert_used_count", int)
        if used > n_experts:
            raise MlxLlamaError(f"{path}: {arch}.expert_used_count {used} is more than {arch}.expert_count {n_experts}")
        config = replace(config, n_experts=n_experts, n_experts_used=used,
                         expert_ffn_size=keys.positive(f"{arch}.expert_feed_forward_length", int, config.ffn_size))
    config = architecture.specialize(config, keys)
    check_shapes(gguf, architecture, config)
    return config


def check_shapes(gguf: GGUFFile, architecture: Architecture, config: ModelConfig) -> None:
    """Every tensor the model reads must be in the file with the shape the config gives it."""
    tensors = gguf.tensors
    for name, (_, shape) in architecture.tensors(config).items():
        if name not in tensors:
            raise MlxLlamaError(f"{gguf.path}: missing tensor {name!r}")
        found = tensor_shape(tensors[name])
        if found != shape:
            raise MlxLlamaError(f"{gguf.path}: tensor {name!r} has shape {found}, expected {shape} from the metadata")


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
    factors = np.array(tensor_to_mlx(gguf.path, tensor, mx.float32), dtype=np.float64)
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


def _rope_scale(keys: Metadata, arch: str) -> float:
    kind = keys.get(f"{arch}.rope.scaling.type", str, "none")
    if kind in ("none", ""):
        # Older converters wrote only the linear factor.
        return 1.0 / keys.positive(f"{arch}.rope.scale_linear", float, 1.0)
    if kind == "linear":
        return 1.0 / keys.positive(f"{arch}.rope.scaling.factor", float, 1.0)
    if kind == "yarn":  # its scaling is per pair (yarn_factors)
        return 1.0
    raise MlxLlamaError(f"{keys.path}: unsupported RoPE scaling type {kind!r} (supported: none, linear, yarn)")


# YaRN's defaults in llama.cpp (llama-hparams.h), which it does not read from the file.
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def yarn_factors(factor: float, rope_dim: int, base: float, original_context: int,
                 log_multiplier: float = 0.0) -> tuple[tuple[float, ...], float]:
    """YaRN as llama.cpp computes it (ggml's rope_yarn, llama_context's yarn_attn_factor): each
    rotated pair's angle divisor, and the scale of the rotated dims.

    Pair i turns at base ** (-2i / rope_dim) times a blend of 1/factor (interpolation) and 1
    (extrapolation): extrapolated below the pair llama.cpp's ggml_rope_yarn_corr_dims finds for
    beta_fast, interpolated above the one for beta_slow, a linear ramp between. Cos and sin are
    scaled by 1 + 0.1 ln(factor) (over the same with log_multiplier, where the file sets one).
    """
    def corr_dim(rotations: float) -> float:
        return rope_dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(YARN_BETA_FAST)))
    high = min(rope_dim - 1.0, math.ceil(corr_dim(YARN_BETA_SLOW)))
    divisors = []
    for i in range(rope_dim // 2):
        extrapolated = 1.0 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))
        divisors.append(1.0 / ((1.0 - extrapolated) / factor + extrapolated))

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1.0 else 0.1 * scale * math.log(factor) + 1.0

    return tuple(divisors), mscale(1.0) / (mscale(log_multiplier) if log_multiplier else 1.0)
