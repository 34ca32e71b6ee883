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
    context_length: int
    vocab_size: int
    tied_output: bool
