"""`llama`: Llama 1/2/3, TinyLlama, Mistral and the many models converted as Llama.

llama.cpp's converter permutes Q and K of this family so that RoPE rotates adjacent pairs. Llama 3
files may carry per-pair RoPE frequency factors (`rope_freqs.weight`), which config.py reads for
every family.
"""

from .architecture import Architecture


class Llama(Architecture):
    name = "llama"
    rope_traditional = True
