"""`qwen3moe`: Qwen3's mixture-of-experts models (Qwen3-30B-A3B and its kin).

Qwen3's attention (Q/K norms, its own head size, NeoX RoPE) over a mixture-of-experts FFN in every
block: a softmax router over `qwen3moe.expert_count` experts, the top `expert_used_count` a token,
their weights renormalized (as llama.cpp computes it), each expert a SwiGLU FFN of
`expert_feed_forward_length` (transformer.Experts). Mixtral is `llama` with the same FFN.
"""

from .architecture import Architecture


class Qwen3Moe(Architecture):
    name = "qwen3moe"
