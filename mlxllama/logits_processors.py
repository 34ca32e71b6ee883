"""What changes the logits before sampling looks at them: the repeat penalty."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx


def apply_repeat_penalty(logits: mx.array, history: Sequence[int], penalty: float, last_n: int,
                         pending: mx.array | None = None) -> mx.array:
    """llama.cpp's rule: a recent token's positive logit is divided by the penalty, a negative one multiplied.

    The window is the last `last_n` tokens (all when negative), `pending` being the newest: the
    token sampled last, whose value the host has not read yet (a 0-d array).
    """
    if penalty == 1.0 or last_n == 0:
        return logits
    from_history = len(history) if last_n < 0 else last_n - (pending is not None)
    recent = mx.array(sorted(set(history[len(history) - from_history:])), mx.uint32)
    if pending is not None:
        recent = mx.concatenate([recent, pending.reshape(1).astype(mx.uint32)])
    if recent.size == 0:
        return logits
    chosen = logits[recent]
    logits[recent] = mx.where(chosen > 0, chosen / penalty, chosen * penalty)
    return logits
