"""Turning logits into the next token: penalties, then temperature, top-k, top-p, min-p."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0  # 1 is off
    repeat_last_n: int = 64
    seed: int | None = None


Sampler = Callable[..., mx.array]


def make_sampler(params: SamplingParams) -> Sampler:
    """A function (logits [vocab], ids so far, pending) -> token id as a 0-d mx.array, seeded per sampler.

    `pending` is the token sampled last whose value the host has not read yet (a 0-d array): the
    decode loop queues the next step before waiting for it, and the penalty must still see it.
    """
    key = mx.random.key(params.seed) if params.seed is not None else None

    def sample(logits: mx.array, history: Sequence[int], pending: mx.array | None = None) -> mx.array:
        nonlocal key
        logits = apply_repeat_penalty(logits, history, params.repeat_penalty, params.repeat_last_n, pending)
        if params.temperature <= 0:
            return mx.argmax(logits, axis=-1)
        logits = filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p)
        if key is None:
            return mx.random.categorical(logits)
        key, step_key = mx.random.split(key)
        return mx.random.categorical(logits, key=step_key)

    return sample


def apply_repeat_penalty(logits: mx.array, history: Sequence[int], penalty: float, last_n: int,
                         pending: mx.array | None = None) -> mx.array:
    """llama.cpp's rule: a recent token's positive logit is divided by the penalty, a negative one multiplied.

    The window is the last `last_n` tokens (all when negative), `pending` being the newest.
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


def filter_logits(logits: mx.array, top_k: int, top_p: float, min_p: float) -> mx.array:
    """Set the logits of tokens outside top-k / the top-p nucleus / below min-p to -inf."""
    neg_inf = mx.array(-float("inf"), logits.dtype)
    if 0 < top_k < logits.shape[-1]:
        kth = mx.min(mx.topk(logits, top_k), axis=-1)
        logits = mx.where(logits < kth, neg_inf, logits)
    if min_p > 0:
        floor = mx.max(logits) + mx.log(mx.array(min_p))
        logits = mx.where(logits < floor, neg_inf, logits)
    if top_p < 1.0:
        order = mx.argsort(-logits)
        probs = mx.softmax(logits[order])
        # Keep a token while the mass before it is below top_p, so the top token always stays.
        mass_before = mx.cumsum(probs) - probs
        drop_sorted = mass_before >= top_p
        drop = mx.zeros(logits.shape, mx.bool_)
        drop[order] = drop_sorted
        logits = mx.where(drop, neg_inf, logits)
    return logits
