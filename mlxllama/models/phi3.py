"""`phi3`: Phi-3 and Phi-3.5 mini.

NeoX RoPE; Q/K/V stored as one `attn_qkv` tensor and gate/up as one `ffn_up` tensor of twice the
FFN width, which the model keeps fused (attn_qkv, ffn_gate_up) and slices by views. The 128k
variants carry LongRoPE's short and long factor sets: config.py picks one by the context length,
as llama.cpp does. llama.cpp's tokenizer gives this family's special tokens an rstrip attribute
(tokenizer.py).
"""

from .architecture import Architecture


class Phi3(Architecture):
    name = "phi3"
    fused_gate_up = True
