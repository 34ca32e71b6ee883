"""What sets one GGUF `general.architecture` apart from the others, and the defaults most share.

A family is a subclass in its own file (llama.py, qwen2.py, qwen3.py, qwen3moe.py, phi3.py, gemma3.py) registered in models/__init__.py:
its RoPE convention, the metadata it reads beyond the shared keys (config.py), the tensors it
reads and the parameters they load into, and its model class. Code outside models/ asks the
architecture or the model, never tests an architecture's name.
"""

from __future__ import annotations

from ..gguf_file import GGUFFile
from .config import Metadata, ModelConfig, read_config
from .transformer import Transformer


class Architecture:
    name: str
    # llama.cpp's converter permutes Q/K of some families so that RoPE rotates adjacent pairs
    # (MLX's traditional=True); the others use the NeoX half-split.
    rope_traditional = False
    # The file holds gate and up as one ffn_up tensor of twice the FFN width.
    fused_gate_up = False
    model_class = Transformer

    def read_config(self, gguf: GGUFFile, context_length: int | None = None) -> ModelConfig:
        return read_config(gguf, self, context_length)

    def specialize(self, config: ModelConfig, keys: Metadata) -> ModelConfig:
        """The config with what this family reads beyond the shared keys (none by default)."""
        return config

    def build(self, config: ModelConfig, compute_dtype, shard=None) -> Transformer:
        """The model with its parameters still unloaded (weights.py loads them); with a
        sharding.Shard, only the part of it one rank of an mlx.launch run holds."""
        return self.model_class(config, compute_dtype, shard)

    def tensors(self, config: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every tensor the model reads: file name -> (the model's parameter path, row-major shape).

        Parameter paths mirror the file's names (`blk.0.attn_q.weight`), except that a file's fused
        gate/up tensor loads into the model's `ffn_gate_up`.
        """
        hidden, q_dim = config.hidden_size, config.n_heads * config.head_dim
        kv_dim = config.n_kv_heads * config.head_dim
        projections = {"attn_qkv": q_dim + 2 * kv_dim} if config.fused_qkv else {
            "attn_q": q_dim, "attn_k": kv_dim, "attn_v": kv_dim}
        names: dict[str, tuple[str, tuple[int, ...]]] = {}

        def add(name: str, shape: tuple[int, ...], parameter: str | None = None) -> None:
            names[name] = (parameter or name, shape)

        add("token_embd.weight", (config.vocab_size, hidden))
        add("output_norm.weight", (hidden,))
        if not config.tied_output:
            add("output.weight", (config.vocab_size, hidden))
        for i in range(config.n_layers):
            for proj, rows in projections.items():
                add(f"blk.{i}.{proj}.weight", (rows, hidden))
                if config.attn_bias:
                    add(f"blk.{i}.{proj}.bias", (rows,))
            add(f"blk.{i}.attn_norm.weight", (hidden,))
            add(f"blk.{i}.attn_output.weight", (hidden, q_dim))
            add(f"blk.{i}.ffn_norm.weight", (hidden,))
            if config.qk_norm:
                add(f"blk.{i}.attn_q_norm.weight", (config.head_dim,))
                add(f"blk.{i}.attn_k_norm.weight", (config.head_dim,))
            if config.post_norms:
                add(f"blk.{i}.post_attention_norm.weight", (hidden,))
                add(f"blk.{i}.post_ffw_norm.weight", (hidden,))
            if config.n_experts:
                experts, width = config.n_experts, config.expert_ffn_size
                add(f"blk.{i}.ffn_gate_inp.weight", (experts, hidden))
                add(f"blk.{i}.ffn_gate_exps.weight", (experts, width, hidden))
                add(f"blk.{i}.ffn_up_exps.weight", (experts, width, hidden))
                add(f"blk.{i}.ffn_down_exps.weight", (experts, hidden, width))
                continue
            if config.fused_gate_up:
                add(f"blk.{i}.ffn_up.weight", (2 * config.ffn_size, hidden), f"blk.{i}.ffn_gate_up.weight")
            else:
                add(f"blk.{i}.ffn_gate.weight", (config.ffn_size, hidden))
                add(f"blk.{i}.ffn_up.weight", (config.ffn_size, hidden))
            add(f"blk.{i}.ffn_down.weight", (hidden, config.ffn_size))
        return names
