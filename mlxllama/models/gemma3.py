"""`gemma3`: Gemma 3 text models (270M, 1B, and the text part of 4B-27B).

Against Llama: embeddings scaled by sqrt(hidden); Q/K norms; norms of the attention's and the
FFN's outputs before each residual add (`post_attention_norm`, `post_ffw_norm`; llama.cpp's converter
has already added Gemma's +1 to every norm weight); a GELU-gated FFN (tanh approximation); NeoX
RoPE. Five of every six layers attend over a sliding window (`gemma3.attention.sliding_window`)
with RoPE base 10,000 and no position scaling; the others over everything, with the file's base
and scaling. Q's scale is 1/sqrt(head size), except for the 62-layer 27B, whose is
1/sqrt(hidden / heads), as llama.cpp has it.
"""

from __future__ import annotations

import dataclasses
import math

from .architecture import Architecture
from .config import Metadata, ModelConfig

# Every SLIDING_PATTERN-th layer attends globally, the others over the window (llama.cpp's default
# for gemma3 when the file gives no `gemma3.attention.sliding_window_pattern`).
SLIDING_PATTERN = 6
LAYERS_27B = 62


class Gemma3(Architecture):
    name = "gemma3"

    def specialize(self, config: ModelConfig, keys: Metadata) -> ModelConfig:
        window = keys.get("gemma3.attention.sliding_window", int, 0)
        sliding = sliding_layers(keys, config.n_layers) if window else ()
        per_head = config.hidden_size // config.n_heads if config.n_layers == LAYERS_27B else config.head_dim
        return dataclasses.replace(
            config, ffn_activation="gelu", embedding_scale=math.sqrt(config.hidden_size),
            attention_scale=per_head**-0.5, final_logit_softcap=float(keys.get("gemma3.final_logit_softcapping", float, 0.0)),
            sliding_window=window, sliding_layers=sliding,
            rope_base_local=float(keys.positive("gemma3.rope.freq_base_swa", float, 10000.0)))


def sliding_layers(keys: Metadata, n_layers: int) -> tuple[bool, ...]:
    """Which layers slide: the file's per-layer flags, or every layer but each pattern-th."""
    key = "gemma3.attention.sliding_window_pattern"
    flags = keys.meta.get(key)
    if isinstance(flags, (list, tuple)) and len(flags) == n_layers:
        return tuple(bool(flag) for flag in flags)
    pattern = keys.get(key, int, SLIDING_PATTERN)
    return tuple(pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers))
