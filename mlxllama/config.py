"""Model hyper-parameters, independent of the file format they were read from."""

from dataclasses import dataclass


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
    # short or long factors, picked by context_length), rope_dim / 2 of them; None: plain RoPE.
    rope_freq_factors: tuple[float, ...] | None = None
    # Scale of the rotated Q/K dims after RoPE (rope.scaling.attn_factor: Phi-3's LongRoPE, which
    # llama.cpp applies with the short factors as well as the long ones).
    rope_attn_factor: float = 1.0
    # Q/K/V projections with biases (Qwen2).
    attn_bias: bool = False
    # The file stores Q/K/V as one attn_qkv tensor and gate/up as one ffn_up tensor (Phi-3);
    # the loader splits them into the separate tensors the model uses.
    fused_qkv: bool = False
    fused_gate_up: bool = False
