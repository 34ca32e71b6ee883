"""What changes the logits before sampling looks at them: llama.cpp's repeat penalty, OpenAI's
presence and frequency penalties, and a bias on chosen tokens."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import mlx.core as mx

from .errors import MlxLlamaError


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


class GeneratedCounts:
    """How often each token was generated so far, kept on the device: the sampler adds each token
    it picks without waiting for its value, so the decode loop never stalls for it."""

    def __init__(self):
        self.counts: mx.array | None = None

    def add(self, token: mx.array) -> None:
        self.counts = self.counts.at[token.reshape(1)].add(1)

    def penalize(self, logits: mx.array, presence: float, frequency: float) -> mx.array:
        """OpenAI's rule: logit - frequency x count - presence x (count > 0)."""
        if self.counts is None:
            self.counts = mx.zeros(logits.shape[-1], mx.float32)
        return logits - frequency * self.counts - presence * (self.counts > 0)


def penalize_counted(logits: mx.array, counts: Counter, presence: float, frequency: float) -> mx.array:
    """GeneratedCounts.penalize's rule for tokens counted on the host (speculative decoding counts
    each drafted position's prefix there)."""
    if not counts:
        return logits
    ids = mx.array(list(counts), mx.uint32)
    return logits.at[ids].add(-frequency * mx.array(list(counts.values()), logits.dtype) - presence)


def apply_logit_bias(logits: mx.array, bias: tuple[tuple[int, float], ...]) -> mx.array:
    vocab = logits.shape[-1]
    outside = [token for token, _ in bias if token >= vocab]
    if outside:
        raise MlxLlamaError(f"logit bias: token id {outside[0]} is not in the vocabulary of {vocab}")
    ids = mx.array([token for token, _ in bias], mx.uint32)
    return logits.at[ids].add(mx.array([value for _, value in bias], logits.dtype))
