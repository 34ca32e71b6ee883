"""`qwen3`: Qwen3 (dense).

Qwen2's layout without the Q/K/V biases, with a per-head RMSNorm of Q and K before RoPE (config.py
finds `attn_q_norm`/`attn_k_norm`), and a head size of its own (`qwen3.attention.key_length`:
Qwen3-0.6B has hidden 1024 and 16 heads of 128). NeoX RoPE. Its template's `enable_thinking` is a
template keyword (`--template-kwargs '{"enable_thinking": false}'`); `<think>` text is shown as the
model writes it.
"""

from .architecture import Architecture


class Qwen3(Architecture):
    name = "qwen3"
