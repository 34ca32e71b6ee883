"""Turning logits into the next token: the logits processors, then temperature, top-k, top-p, min-p."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Sequence

import mlx.core as mx

from .distributed import follow_rank0
from .errors import MlxLlamaError
from .logits_processors import GeneratedCounts, apply_logit_bias, apply_repeat_penalty, penalize_counted


class InvalidSampling(MlxLlamaError):
    """A sampling setting out of its range; the CLI names the option, the Python API the field."""

    def __init__(self, name: str, must: str, value: Any):
        super().__init__(f"sampling setting '{name}' must be {must}, got {value!r}")
        self.name, self.must, self.value = name, must, value


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token: the one definition the CLI, `batch` lines and the Python API share.

    Invalid values raise MlxLlamaError naming the field, whoever passes them.
    """

    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with this mass
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    repeat_penalty: float = 1.0  # 1 is off
    repeat_last_n: int = 64  # window of the repeat penalty; -1: everything so far
    seed: int | None = None  # None: a random seed
    # OpenAI's penalties, subtracted from a token's logit for each time it was generated before
    # (frequency) and once if it was at all (presence); 0 is off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # (token id, bias) pairs added to those tokens' logits, OpenAI's logit_bias.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        def check(name: str, ok: bool, must: str) -> None:
            if not ok:
                raise InvalidSampling(name, must, getattr(self, name))

        def number(value: Any) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        def integer(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        check("temperature", number(self.temperature) and self.temperature >= 0, "a finite number >= 0")
        check("top_k", integer(self.top_k) and self.top_k >= 0, "an integer >= 0")
        check("top_p", number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]")
        check("min_p", number(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]")
        check("repeat_penalty", number(self.repeat_penalty) and self.repeat_penalty > 0, "a finite number > 0")
        check("repeat_last_n", integer(self.repeat_last_n) and self.repeat_last_n >= -1, "an integer >= -1")
        check("seed", self.seed is None or integer(self.seed) and self.seed >= 0, "null or an integer >= 0")
        check("presence_penalty", number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
              "a number in [-2, 2]")
        check("frequency_penalty", number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
              "a number in [-2, 2]")
        check("logit_bias", isinstance(self.logit_bias, tuple) and all(
            isinstance(pair, tuple) and len(pair) == 2 and integer(pair[0]) and pair[0] >= 0 and number(pair[1])
            and -100 <= pair[1] <= 100 for pair in self.logit_bias), "(token id, bias in [-100, 100]) pairs")

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no logits processor: each pick is the argmax of the model's logits alone."""
        return (self.temperature <= 0 and (self.repeat_penalty == 1.0 or self.repeat_last_n == 0)
                and not self.presence_penalty and not self.frequency_penalty and not self.logit_bias)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def with_overrides(self, **overrides: Any) -> SamplingParams:
        """These settings with some fields replaced (checked again); an unknown name is an error."""
        unknown = sorted(set(overrides) - set(self.names()))
        if unknown:
            raise TypeError(f"unknown sampling setting(s): {', '.join(unknown)} (known: {', '.join(self.names())})")
        return replace(self, **overrides)


Sampler = Callable[..., mx.array]


def make_sampler(params: SamplingParams, group=None) -> Sampler:
    """A function (logits [vocab], ids so far, pending, allowed) -> token id as a 0-d mx.array,
    seeded per sampler.

    `pending` is the token sampled last whose value the host has not read yet (a 0-d array): the
    decode loop queues the next step before waiting for it, and the penalty must still see it.
    `allowed` (a bool per logit) is a constraint's mask (constraints.Guide): the other tokens are
    ruled out after the penalties and bias and before temperature, top-k, top-p and min-p, so
    those filters, and greedy's argmax, choose among allowed tokens only.

    `group`: the ranks a split model runs on (Transformer.sampling_group), which all take rank 0's token.
    """
    key = mx.random.key(params.seed) if params.seed is not None else None
    generated = GeneratedCounts() if params.presence_penalty or params.frequency_penalty else None
    ruled_out = mx.array(-float("inf"), mx.float32)  # made once: a new host scalar a step costs a transfer on CUDA

    def sample(logits: mx.array, history: Sequence[int], pending: mx.array | None = None,
               allowed: mx.array | None = None) -> mx.array:
        nonlocal key
        logits = process_logits(logits, params, history, generated, pending)
        if allowed is not None:
            logits = mx.where(allowed, logits, ruled_out.astype(logits.dtype))
        if params.temperature <= 0:
            token = mx.argmax(logits, axis=-1)
        else:
            logits = filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p)
            if key is None:
                token = mx.random.categorical(logits)
            else:
                key, step_key = mx.random.split(key)
                token = mx.random.categorical(logits, key=step_key)
        if group is not None:
            token = follow_rank0(token, group)
        if generated is not None:
            generated.add(token)
        return token

    return sample


def process_logits(logits: mx.array, params: SamplingParams, history: Sequence[int], generated=None,
                   pending: mx.array | None = None) -> mx.array:
    """Plain decoding's logits processors, in its order: the repeat penalty over `history` (and
    `pending`), the presence and frequency penalties over `generated` (GeneratedCounts, or a
    Counter of the ids generated so far; None: no penalty), the logit bias. Speculative decoding
    applies the same at every drafted position."""
    logits = apply_repeat_penalty(logits, history, params.repeat_penalty, params.repeat_last_n, pending)
    presence, frequency = params.presence_penalty, params.frequency_penalty
    if generated is not None and (presence or frequency):
        logits = (generated.penalize(logits, presence, frequency) if isinstance(generated, GeneratedCounts)
                  else penalize_counted(logits, generated, presence, frequency))
    if params.logit_bias:
        logits = apply_logit_bias(logits, params.logit_bias)
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
