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

from .cache import rotates
from .errors import MlxLlamaError
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

    def pick(self, logits: mx.array, context: Sequence[int], generated: Counter) -> int:
        """The model's token after `context` from its logits there."""
        logits = process_logits(logits, self.params, context, generated)
        if self.params.temperature <= 0:
            return int(mx.argmax(logits).item())
        return self.draw(distribution(logits, self.params))

    def check(self, logits: mx.array, context: Sequence[int], generated: Counter, draft: int,
              q: mx.array | None) -> tuple[bool, int]:
        """(kept, token) for a draft at a position: greedy keeps it where it is the model's pick;
        sampled keeps it with probability min(1, p(d) / q(d)) (q None: all on the draft), else
        draws from max(0, p - q) normalized."""
        logits = process_logits(logits, self.params, context, generated)
        if self.params.temperature <= 0:
            token = int(mx.argmax(logits).item())
            return token == draft, token
        return rejection_step(distribution(logits, self.params), q, draft, self)


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
    `ngram` down to 1): replies that copy from the prompt (edits, summaries, code) draft well."""

    def __init__(self, ngram: int):
        if ngram < 1:
            raise MlxLlamaError("--lookup takes the n-gram length to match, at least 1")
        self.ngram = ngram

    def propose(self, context: Sequence[int], k: int, chooser: Chooser) -> tuple[list[int], list[None]]:
        """Up to k drafts; their distribution is all on them (None)."""
        for size in range(min(self.ngram, len(context) - 1), 0, -1):
            tail = list(context[-size:])
            for start in range(len(context) - size - 1, -1, -1):
                if list(context[start : start + size]) == tail:
                    drafts = list(context[start + size : start + size + k])
                    return drafts, [None] * len(drafts)
        return [], []


class DraftModel:
    """Drafts with a smaller model of the same vocabulary, from a cache of its own that follows the
    text (trimmed to what it shares with the text before each proposal)."""

    def __init__(self, runtime, target_tokenizer, max_kv_size: int = 0, keep: int = 0):
        check_same_vocabulary(runtime.tokenizer, target_tokenizer, runtime.path)
        self.model = runtime.model
        # Bounded as the model's own cache is (max_kv_size: a rotating cache), so that a long run
        # holds no more for the draft than for the model.
        self.bounds = dict(bounded=bool(max_kv_size), max_kv_size=max_kv_size, keep=keep)
        self.cache = runtime.model.make_cache(**self.bounds)
        self.fed: list[int] = []

    def propose(self, context: Sequence[int], k: int, chooser: Chooser) -> tuple[list[int], list[mx.array | None]]:
        """Up to k drafts after `context`, greedy or drawn from the draft's own distribution (with
        the model's sampling settings), and that distribution at each (None when greedy)."""
        shared = common_prefix(self.fed, context, len(context) - 1)  # at least one token to feed, for the next logits
        for layer in self.cache:
            layer.trim(self.cache[0].offset - shared)
        if self.cache[0].offset != shared:  # a rotating cache that dropped what the text went back to
            self.cache, shared = self.model.make_cache(**self.bounds), 0
        logits = prefill(self.model, list(context[shared:]), self.cache)
        drafts, qs = [], []
        while True:
            logits = process_logits(logits, chooser.params, list(context) + drafts, Counter())
            if chooser.params.temperature <= 0:
                drafts.append(int(mx.argmax(logits).item()))
                qs.append(None)
            else:
                qs.append(distribution(logits, chooser.params))
                drafts.append(chooser.draw(qs[-1]))
            if len(drafts) == k:
                break
            logits = self.model.step(mx.array([[drafts[-1]]]), self.cache)[0]
        self.fed = list(context) + drafts[:-1]
        return drafts, qs


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

    def __call__(self, model, cache, new_ids, max_tokens, stop_ids, history) -> Iterator[int]:
        return speculative_tokens(model, cache, new_ids, self.params, max_tokens, stop_ids, history, self)


def speculative_tokens(model, cache, new_ids: Sequence[int], params: SamplingParams, max_tokens: int,
                       stop_ids, history: Sequence[int], speculation: Speculation) -> Iterator[int]:
    """generate_tokens' contract, with drafts checked k at a time: up to max_tokens ids, each fed
    into the cache by the end (a stop id is yielded, then generation ends)."""
    # A rotating cache may run past the context: only the drafts' own bound limits them then.
    context_length = math.inf if rotates(cache) else model.config.context_length
    max_tokens = generation_room(model, cache, new_ids, max_tokens)
    if max_tokens <= 0:
        return
    stop_ids = frozenset(stop_ids)
    context, generated = list(history) + list(new_ids), Counter()
    chooser = Chooser(params)
    token = chooser.pick(prefill(model, new_ids, cache), context, generated)
    produced = 0
    while True:
        # `token` is decided and not yet fed: emit it, then feed it with the next drafts.
        context.append(token)
        generated[token] += 1
        produced += 1
        yield token
        if token in stop_ids or produced == max_tokens:
            model.step(mx.array([[token]]), cache)  # so the cache holds every yielded id
            mx.eval([c.state for c in cache])
            return
        room = min(speculation.k, max_tokens - produced, context_length - cache[0].offset - 2)
        drafts, qs = speculation.drafter.propose(context, room, chooser) if room > 0 else ([], [])
        logits = model(mx.array([[token] + drafts]), cache)[0]
        accepted, following = [], None
        for i, draft in enumerate(drafts):
            kept, chosen = chooser.check(logits[i], context + accepted, generated + Counter(accepted), draft, qs[i])
            if not kept:
                following = chosen  # the model's own token in the rejected draft's place
                break
            accepted.append(draft)
        speculation.drafted += len(drafts)
        speculation.accepted += len(accepted)
        for layer in cache:
            layer.trim(len(drafts) - len(accepted))
        if following is None:  # every draft kept: the model's token after them, from the last row
            following = chooser.pick(logits[len(accepted)], context + accepted, generated + Counter(accepted))
        for n, draft in enumerate(accepted, 1):
            context.append(draft)
            generated[draft] += 1
            produced += 1
            yield draft
            if draft in stop_ids or produced == max_tokens:
                # The cache holds this draft and the accepted ones after it: cut those off.
                for layer in cache:
                    layer.trim(len(accepted) - n)
                return
        token = following
