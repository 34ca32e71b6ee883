"""Speculative decoding: a cheap drafter proposes k tokens, the model checks them all in one
forward pass, and keeps the longest prefix it agrees with plus one token of its own.

Decoding one sequence reads every weight once a token; checking k drafted tokens reads them once
for up to k + 1. The drafter is a smaller model of the same vocabulary (DraftModel) or the text so
far (PromptLookup: what followed the last n-gram the last time it occurred, llama.cpp's lookup
decoding). The model's distribution at each drafted position is plain decoding's — the same
logits processors (penalties over that position's prefix, bias), temperature and filters — so:

- greedy, a draft is kept where it is the model's pick, and the output is the plain greedy output
  (up to near-ties: checking k + 1 positions in one pass rounds differently from k + 1 single
  steps);
- sampled, a draft d drawn from the drafter's distribution q is kept with probability
  min(1, p(d) / q(d)), else the token is drawn from max(0, p - q) normalized, which makes each
  token follow p exactly (the standard rule); prompt lookup's q is all on its draft.

Rejected positions are trimmed from the cache, which then holds exactly what a run that never
drafted would hold.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Sequence

import mlx.core as mx
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .cache import rotates
from .constraints import Guide
from .errors import MlxLlamaError, count
from .generate import generation_room, prefill
from .prompt_cache import common_prefix
from .sampling import SamplingParams, filter_logits, process_logits


def distribution(logits: mx.array, params: SamplingParams) -> mx.array:
    """The probabilities plain sampling draws from, given processed logits (temperature > 0)."""
    return mx.softmax(filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p))


class Chooser:
    """The model's choice at a position, greedy or sampled, with its own seeded random stream."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.key = mx.random.key(params.seed) if params.seed is not None else None

    def _next_key(self):
        if self.key is None:
            return None
        self.key, step = mx.random.split(self.key)
        return step

    def draw(self, probs: mx.array) -> int:
        return int(mx.random.categorical(mx.log(probs), key=self._next_key()).item())

    def uniform(self) -> float:
        return float(mx.random.uniform(key=self._next_key()).item())

    def processed(self, logits: mx.array, context: Sequence[int], generated: Counter,
                  allowed: mx.array | None) -> mx.array:
        """Plain decoding's processors, then a constraint's mask (allowed), as make_sampler applies them."""
        logits = process_logits(logits, self.params, context, generated)
        return logits if allowed is None else mx.where(allowed, logits, mx.array(-math.inf, logits.dtype))

    def pick(self, logits: mx.array, context: Sequence[int], generated: Counter, allowed: mx.array | None = None) -> int:
        """The model's token after `context` from its logits there (among the `allowed`, if given)."""
        logits = self.processed(logits, context, generated, allowed)
        if self.params.temperature <= 0:
            return int(mx.argmax(logits).item())
        return self.draw(distribution(logits, self.params))

    def check(self, logits: mx.array, context: Sequence[int], generated: Counter, draft: int,
              q: mx.array | None, allowed: mx.array | None = None) -> tuple[bool, int]:
        """(kept, token) for a draft at a position: greedy keeps it where it is the model's pick;
        sampled keeps it with probability min(1, p(d) / q(d)) (q None: all on the draft), else
        draws from max(0, p - q) normalized. A draft the constraint rules out has p(d) = 0."""
        logits = self.processed(logits, context, generated, allowed)
        if self.params.temperature <= 0:
            token = int(mx.argmax(logits).item())
            return token == draft, token
        return rejection_step(distribution(logits, self.params), q, draft, self)


def verify(chooser: Chooser, logits: mx.array, drafts: Sequence[int], qs: Sequence[mx.array | None],
           context: Sequence[int], generated: Counter, guide: Guide | None = None) -> tuple[list[int], int]:
    """The drafts the model keeps, and its own token after them: logits[i] are the model's after
    context + drafts[:i] (one pass over the last decided token and the drafts). With a guide (a
    constraint), each position's mask is the guide's after the drafts kept before it; the guide
    is left as it was found, for the caller to feed the kept tokens as they are emitted."""
    if guide is None and chooser.params.plain_greedy:
        # Every position's pick at once: one read from the device instead of one a position.
        picks = mx.argmax(logits[: len(drafts) + 1], axis=-1).tolist()
        kept = next((i for i, (draft, pick) in enumerate(zip(drafts, picks)) if draft != pick), len(drafts))
        return list(drafts[:kept]), picks[kept]
    accepted: list[int] = []
    try:
        for i, draft in enumerate(drafts):
            allowed = guide.allowed(logits.shape[-1]) if guide is not None else None
            kept, chosen = chooser.check(logits[i], list(context) + accepted, generated + Counter(accepted), draft,
                                         qs[i], allowed)
            if not kept:
                return accepted, chosen  # the model's own token in the rejected draft's place
            accepted.append(draft)
            if guide is not None:
                guide.accept(draft)
        allowed = guide.allowed(logits.shape[-1]) if guide is not None else None
        return accepted, chooser.pick(logits[len(accepted)], list(context) + accepted, generated + Counter(accepted),
                                      allowed)
    finally:
        if guide is not None and accepted:
            guide.rollback(len(accepted))


def rejection_step(p: mx.array, q: mx.array | None, draft: int, chooser: Chooser) -> tuple[bool, int]:
    """The standard rule: keep `draft` (drawn from q) with probability min(1, p/q) at it, else draw
    from the residual max(0, p - q), normalized; the token is then distributed as p."""
    q_draft = 1.0 if q is None else float(q[draft].item())
    if chooser.uniform() * q_draft < float(p[draft].item()):
        return True, draft
    residual = p.at[draft].add(-1.0) if q is None else p - q
    residual = mx.maximum(residual, 0.0)
    mass = float(residual.sum().item())
    return False, chooser.draw(residual / mass if mass > 0 else p)  # (no mass left: p itself, by rounding)


class PromptLookup:
    """Drafts what followed the latest earlier occurrence of the text's last n-gram (n from
    `ngram` down to 1): replies that copy from the prompt (edits, summaries, code) draft well.

    With a `reference` (a predicted reply, as OpenAI's Predicted Outputs give one), the n-gram is
    looked for there first, from where the last match in it left off, so a reply that follows the
    prediction is drafted from it in order."""

    def __init__(self, ngram: int, reference: Sequence[int] = ()):
        if ngram < 1:
            raise MlxLlamaError("--lookup takes the n-gram length to match, at least 1")
        self.ngram = ngram
        self.reference = np.asarray(reference, dtype=np.int64)
        self.cursor = 0  # where in the reference the last match ended

    def propose(self, context: Sequence[int], k: int, chooser: Chooser,
                guide: Guide | None = None) -> tuple[list[int], list[None]]:
        """Up to k drafts (cut where a constraint's guide would rule one out); their distribution
        is all on them (None)."""
        ids = np.asarray(context, dtype=np.int64)
        drafts: list[int] = []
        for size in range(min(self.ngram, len(ids) - 1), 0, -1):
            drafts = self._from_reference(ids[-size:], k) or _after_latest(ids, size, k)
            if drafts:
                break
        if guide is not None:
            drafts = drafts[: guide.allows_prefix(drafts)]
        return drafts, [None] * len(drafts)

    def _from_reference(self, tail: np.ndarray, k: int) -> list[int]:
        if len(self.reference) <= len(tail):
            return []
        hits = np.flatnonzero((sliding_window_view(self.reference[:-1], len(tail)) == tail).all(axis=1))
        if not hits.size:
            return []
        later = hits[hits >= self.cursor]
        start = int(later[0] if later.size else hits[0]) + len(tail)
        self.cursor = start
        return self.reference[start : start + k].tolist()


def _after_latest(ids: np.ndarray, size: int, k: int) -> list[int]:
    """The k ids after the latest earlier occurrence of the last `size` ids (none if it has none)."""
    hits = np.flatnonzero((sliding_window_view(ids[:-1], size) == ids[-size:]).all(axis=1))
    if not hits.size:
        return []
    start = int(hits[-1]) + size
    return ids[start : start + k].tolist()


class DraftModel:
    """Drafts with a smaller model of the same vocabulary (checked by `Drafting.with_model`), from a
    cache of its own that follows the text (trimmed to what it shares with the text before each
    proposal). Sequences drafted for at once each have their own DraftModel over one shared model."""

    def __init__(self, model, max_kv_size: int = 0, keep: int = 0):
        self.model = model
        # Bounded as the model's own cache is (max_kv_size: a rotating cache), so that a long run
        # holds no more for the draft than for the model.
        self.bounds = dict(bounded=bool(max_kv_size), max_kv_size=max_kv_size, keep=keep)
        self.cache = model.make_cache(**self.bounds)
        self.fed: list[int] = []

    def propose(self, context: Sequence[int], k: int, chooser: Chooser,
                guide: Guide | None = None) -> tuple[list[int], list[mx.array | None]]:
        """Up to k drafts after `context`, greedy or drawn from the draft's own distribution (with
        the model's sampling settings, and a constraint's mask where a guide is given), and that
        distribution at each (None when greedy)."""
        shared = common_prefix(self.fed, context, len(context) - 1)  # at least one token to feed, for the next logits
        for layer in self.cache:
            layer.trim(self.cache[0].offset - shared)
        if self.cache[0].offset != shared:  # a rotating cache that dropped what the text went back to
            self.cache, shared = self.model.make_cache(**self.bounds), 0
        logits = prefill(self.model, list(context[shared:]), self.cache)
        drafts, qs = [], []
        try:
            while True:
                allowed = guide.allowed(logits.shape[-1]) if guide is not None else None
                logits = chooser.processed(logits, list(context) + drafts, Counter(), allowed)
                if chooser.params.temperature <= 0:
                    drafts.append(int(mx.argmax(logits).item()))
                    qs.append(None)
                else:
                    qs.append(distribution(logits, chooser.params))
                    drafts.append(chooser.draw(qs[-1]))
                if guide is not None:
                    guide.accept(drafts[-1])
                if len(drafts) == k:
                    break
                logits = self.model.step(mx.array([[drafts[-1]]]), self.cache)[0]
        finally:
            if guide is not None:
                guide.rollback(len(drafts))
        self.fed = list(context) + drafts[:-1]
        return drafts, qs


@dataclass(frozen=True)
class Drafting:
    """How a sequence is drafted for, k tokens at a time: prompt lookup over n-grams of up to
    `lookup` tokens (in a `reference` first, where one is given), or a draft model (`model`, a Transformer whose vocabulary was checked: make it
    with `with_model`). One Drafting serves many sequences: each gets a drafter of its own."""

    k: int = 4
    lookup: int | None = None
    model: object = None
    reference: tuple[int, ...] = ()  # for lookup: a predicted reply to draft from first (PromptLookup)

    def __post_init__(self):
        if self.k < 1:
            raise MlxLlamaError("--draft-tokens must be at least 1")
        if (self.lookup is None) == (self.model is None):
            raise MlxLlamaError("--draft-model and --lookup exclude each other: give one drafter")
        if self.lookup is not None and self.lookup < 1:
            raise MlxLlamaError("--lookup takes the n-gram length to match, at least 1")

    @classmethod
    def with_model(cls, draft, target_tokenizer, k: int = 4) -> Drafting:
        """Drafting by `draft` (a loaded Runtime) for a model of `target_tokenizer`'s vocabulary."""
        check_same_vocabulary(draft.tokenizer, target_tokenizer, draft.path)
        return cls(k, model=draft.model)

    def drafter(self, max_kv_size: int = 0, keep: int = 0) -> PromptLookup | DraftModel:
        """A new sequence's drafter (a draft model's cache bounded as the sequence's own is)."""
        if self.lookup is not None:
            return PromptLookup(self.lookup, self.reference)
        return DraftModel(self.model, max_kv_size, keep)


def acceptance_note(drafted: int, accepted: int) -> str:
    """What the command line says of a reply's drafts (on stderr)."""
    return f"[speculative: {accepted} of {count(drafted, 'drafted token')} accepted ({accepted / drafted:.0%})]"


def check_same_vocabulary(draft, target, path: str) -> None:
    """The draft's token ids must mean the target's: the same size, pieces and special ids."""
    if draft.vocab_size != target.vocab_size:
        raise MlxLlamaError(f"{path}: the draft's vocabulary has {draft.vocab_size} tokens, the model's {target.vocab_size}")
    for name in ("bos_id", "eos_id"):
        if getattr(draft, name) != getattr(target, name):
            raise MlxLlamaError(f"{path}: the draft's {name} is {getattr(draft, name)}, the model's {getattr(target, name)}")
    for i in range(target.vocab_size):
        if draft.id_to_piece(i) != target.id_to_piece(i):
            raise MlxLlamaError(f"{path}: token {i} is {draft.id_to_piece(i)!r} in the draft's vocabulary,"
                                f" {target.id_to_piece(i)!r} in the model's")


class Backoff:
    """How long a drafter rests after proposing nothing: its sequence then decodes 1, 2, 4 … up to
    REST_LIMIT tokens as plain decoding does, each step queued before the host reads the token
    before it, and drafts at every token again once a proposal has drafts. A check must read its
    token before the next step is queued, so without this, text that copies nothing decoded at
    about 0.6 of plain decoding's rate through the CUDA kernels (docs/benchmarks.md)."""

    REST_LIMIT = 8

    def __init__(self):
        self.rest = 0  # tokens to decode before the next proposal
        self._next_rest = 1

    def proposed(self, drafts: Sequence[int]) -> None:
        if drafts:
            self._next_rest = 1
        else:
            self.rest, self._next_rest = self._next_rest, min(2 * self._next_rest, self.REST_LIMIT)

    def rests(self) -> bool:
        """Whether this token is one of the rest's (counted down), for a caller that decodes a token a step."""
        if self.rest == 0:
            return False
        self.rest -= 1
        return True


def plain_steps(model, cache, token: int, steps: int) -> list[int]:
    """The greedy tokens of `steps` decode steps from `token`, each queued before the host reads the
    one before it, as generate's loop runs: the cache then holds `token` and all but the last."""
    fed, picks = mx.array([[token]]), []
    for _ in range(steps):
        fed = mx.argmax(model.step(fed, cache), axis=-1, keepdims=True)
        mx.async_eval(fed)
        picks.append(fed)
    return [int(pick.item()) for pick in picks]


@dataclass
class Speculation:
    """A drafter, how many tokens it drafts at a time and the sampling settings they are checked
    with; counts what it drafted and what was kept. Called as generate_tokens is (TextStream's
    `speculate`)."""

    drafter: PromptLookup | DraftModel
    params: SamplingParams
    k: int = 4
    drafted: int = 0
    accepted: int = 0

    def __post_init__(self):
        if self.k < 1:
            raise MlxLlamaError("--draft-tokens must be at least 1")

    def __call__(self, model, cache, new_ids, max_tokens, stop_ids, history, guide=None) -> Iterator[int]:
        return speculative_tokens(model, cache, new_ids, self.params, max_tokens, stop_ids, history, self, guide)


def speculative_tokens(model, cache, new_ids: Sequence[int], params: SamplingParams, max_tokens: int,
                       stop_ids, history: Sequence[int], speculation: Speculation,
                       guide: Guide | None = None) -> Iterator[int]:
    """generate_tokens' contract, with drafts checked k at a time: up to max_tokens ids, each fed
    into the cache by the end (a stop id is yielded, then generation ends); with a guide, each
    among the tokens its constraint allows."""
    # A rotating cache may run past the context: only the drafts' own bound limits them then.
    context_length = math.inf if rotates(cache) else model.config.context_length
    max_tokens = generation_room(model, cache, new_ids, max_tokens)
    if max_tokens <= 0:
        return
    stop_ids = frozenset(stop_ids)
    context, generated = list(history) + list(new_ids), Counter()
    chooser, backoff = Chooser(params), Backoff()
    # Tokens chosen on the device (plain_steps) are the chooser's only where it is a plain argmax.
    rests = params.plain_greedy and guide is None
    logits = prefill(model, new_ids, cache)
    token = chooser.pick(logits, context, generated, guide.allowed(logits.shape[-1]) if guide is not None else None)
    produced = 0

    def emit(token: int) -> None:
        nonlocal produced
        context.append(token)
        generated[token] += 1
        produced += 1
        if guide is not None:
            guide.accept(token)

    while True:
        # `token` is decided and not yet fed: emit it, then feed it with the next drafts.
        emit(token)
        yield token
        if token in stop_ids or produced == max_tokens:
            model.step(mx.array([[token]]), cache)  # so the cache holds every yielded id
            mx.eval([c.state for c in cache])
            return
        room = min(speculation.k, max_tokens - produced, context_length - cache[0].offset - 2)
        drafts, qs = speculation.drafter.propose(context, room, chooser, guide) if room > 0 else ([], [])
        backoff.proposed(drafts)
        if not drafts and rests:
            picks = plain_steps(model, cache, token, min(backoff.rest, max_tokens - produced))
            for n, pick in enumerate(picks[:-1], 1):
                emit(pick)
                yield pick
                if pick in stop_ids or produced == max_tokens:
                    for layer in cache:  # it fed the picks after this one
                        layer.trim(len(picks) - 1 - n)
                    return
            token = picks[-1]
            continue
        logits = model.check_drafts(mx.array([[token] + drafts]), cache)[0]
        accepted, following = verify(chooser, logits, drafts, qs, context, generated, guide)
        speculation.drafted += len(drafts)
        speculation.accepted += len(accepted)
        for layer in cache:
            layer.trim(len(drafts) - len(accepted))
        for n, draft in enumerate(accepted, 1):
            emit(draft)
            yield draft
            if draft in stop_ids or produced == max_tokens:
                # The cache holds this draft and the accepted ones after it: cut those off.
                for layer in cache:
                    layer.trim(len(accepted) - n)
                return
        token = following
