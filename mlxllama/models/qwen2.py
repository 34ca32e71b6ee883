"""`qwen2`: Qwen2 and Qwen2.5.

NeoX RoPE (the converter does not permute Q/K), and biases on the Q, K and V projections, which
config.py finds from the file's `attn_q.bias` tensors.
"""

from .architecture import Architecture


class Qwen2(Architecture):
    name = "qwen2"
