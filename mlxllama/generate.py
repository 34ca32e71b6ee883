"""The generation loop: prefill the prompt, then one token per step, streaming text as it completes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import mlx.core as mx

from .cache import KVCache, rotates
from .constraints import Guide
from .errors import MlxLlamaError, count
from .models import Transformer
from .sampling import Sampler
from .tokenizer import StreamingDetokenizer, Tokenizer

# Prompt ids fed to the model at once. On the CPU, where attention is matrix products whose scores
# grow with the chunk, 512 is the faster (and it is the server's default chunk between two decode
# steps). On a GPU each chunk dequantizes every weight for its products (quantized_layers.NativeLinear)
# and pays a pass of launches, so that fewer, longer chunks prefill faster: a TinyLlama-shape pp2048
# on an H200 ran 2.3x as fast in one chunk as in four (docs/benchmarks.md, "Prefill in chunks of
# 2,048"); 2,048 is mlx-lm's chunk too.
PREFILL_CHUNK = 512
GPU_PREFILL_CHUNK = 2048


def prefill_chunk() -> int:
    """Prompt ids a prefill feeds at once on the default device."""
    return GPU_PREFILL_CHUNK if mx.default_device() == mx.gpu else PREFILL_CHUNK


def prefill(model: Transformer, ids: Sequence[int], cache: list[KVCache]) -> mx.array:
    """Feed ids into the cache in chunks; return the logits [vocab] after the last one (lazy).

    Only the last position's logits are wanted, so the output head runs on that row alone.
    """
    chunk = prefill_chunk()
    for start in range(0, len(ids), chunk):
        hidden = model.hidden_states(mx.array([ids[start : start + chunk]]), cache)
        if start + chunk < len(ids):
            mx.eval([c.state for c in cache])
    return model.head(hidden[:, -1:])[0, -1]


def check_fits(n_tokens: int, context_length: int | None, hint: str = "") -> None:
    """A prompt of n_tokens (what the cache already holds included) must be non-empty and fit the
    context (None: a cache that rotates, which any length fits)."""
    if n_tokens == 0:
        raise MlxLlamaError("the prompt is empty: generation needs at least one token to feed")
    if context_length is not None and n_tokens > context_length:
        raise MlxLlamaError(f"prompt is {count(n_tokens, 'token')}, more than the model's context of {context_length}{hint}")


def generation_room(model: Transformer, cache: list[KVCache], new_ids: Sequence[int], max_tokens: int) -> int:
    """How many tokens may follow new_ids fed on top of the cache: max_tokens, less what would pass
    the model's context (checked to fit, with new_ids, first). A rotating cache holds a bounded
    window whatever the positions, so with one they may pass the context."""
    if rotates(cache):
        check_fits(len(new_ids), None)
        return max_tokens
    context_length = model.config.context_length
    check_fits(len(new_ids), context_length)
    check_fits(cache[0].offset + len(new_ids), context_length)
    return min(max_tokens, context_length - cache[0].offset - len(new_ids))


def truncate_prompt(ids: Sequence[int], context_length: int, max_tokens: int, bos_id: int | None) -> list[int]:
    """The prompt cut to leave room for the reply, the policy of `generate --truncate`.

    The reply gets room for max_tokens, but at most half the context; the prompt keeps its first
    token when that is BOS, then its last tokens, as many as fit. The end is kept because it is
    what the reply continues (with a template, the generation prompt). A prompt that already
    leaves that room is returned unchanged.
    """
    keep = context_length - min(max_tokens, context_length // 2)
    if len(ids) <= keep:
        return list(ids)
    head = [ids[0]] if bos_id is not None and ids[0] == bos_id else []
    return head + list(ids[len(ids) - (keep - len(head)) :])


def generate_tokens(
    model: Transformer,
    cache: list[KVCache],
    new_ids: Sequence[int],
    sampler: Sampler,
    max_tokens: int,
    stop_ids: Iterable[int] = (),
    history: Sequence[int] = (),
    guide: Guide | None = None,
) -> Iterator[int]:
    """Feed new_ids on top of what the cache holds, then yield up to max_tokens sampled ids.

    Every yielded id has already been fed into the cache (the next step is queued before the
    host waits for the current token), so afterwards the cache holds exactly
    history + new_ids + the yielded ids. A stop id is yielded, then generation ends.

    With a guide (a constraint), each token is sampled among those it allows. Its mask for the
    next token needs the current token's value, so the host reads that while the device runs the
    next step's forward pass, and builds the mask then: only the sampling waits for it.
    """
    max_tokens = generation_room(model, cache, new_ids, max_tokens)
    stop_ids = frozenset(stop_ids)
    context = list(history) + list(new_ids)
    if max_tokens <= 0:
        return
    logits = prefill(model, new_ids, cache)
    token = sampler(logits, context, allowed=guide.allowed(logits.shape[-1]) if guide else None)
    mx.async_eval(token)
    for n in range(1, max_tokens + 1):
        logits = model.step(token.reshape(1, 1), cache)[0]
        if guide is None:
            next_token = sampler(logits, context, token)
            mx.async_eval(next_token)
            token_id = token.item()
        else:
            mx.async_eval(logits)
            token_id = token.item()
            guide.accept(token_id)
            next_token = sampler(logits, context, token, guide.allowed(logits.shape[-1]))
            mx.async_eval(next_token)
        context.append(token_id)
        yield token_id
        if token_id in stop_ids or n == max_tokens:
            # The queued step already fed token_id into the cache; finish it so the cache is whole.
            mx.eval(next_token)
            return
        token = next_token


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str  # "stop" (stop token or string) or "length"
    prompt_tokens_per_second: float = 0.0
    generation_tokens_per_second: float = 0.0
    stop: str | None = field(default=None)  # the stop string that ended generation, if any
    # Speculative decoding: tokens drafted, and those the model kept (0 and 0 without it).
    drafted: int = 0
    accepted: int = 0

    @classmethod
    def of(cls, collector: TextCollector, prompt_ids: Sequence[int], ids: list[int], fed: int, start: float,
           first_token_time: float | None) -> GenerationResult:
        """The result of a finished generation: its collector's text and ending, and its speeds
        (`fed` prompt tokens from `start` to the first token, the rest from there to now)."""
        end = time.perf_counter()
        first = first_token_time or end
        return cls(
            text=collector.text,
            token_ids=ids,
            prompt_ids=list(prompt_ids),
            finish_reason=collector.finish or "length",
            prompt_tokens_per_second=fed / max(first - start, 1e-9),
            generation_tokens_per_second=(len(ids) - 1) / (end - first) if len(ids) > 1 else 0.0,
            stop=collector.stop,
        )

    def timings(self) -> dict:
        return {"prompt_tokens_per_second": round(self.prompt_tokens_per_second, 2),
                "generation_tokens_per_second": round(self.generation_tokens_per_second, 2)}

    def to_dict(self) -> dict:
        speculation = {"drafted": self.drafted, "accepted": self.accepted,
                       "acceptance": round(self.accepted / self.drafted, 4)} if self.drafted else {}
        return {
            "prompt_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            **self.timings(),
            **speculation,
        }


class TextCollector:
    """The text of generated ids, piece by piece as it becomes final.

    Generation ends at a stop id or a stop string (`finish` becomes "stop"). Stop strings are
    matched across token boundaries: text that could still become a stop string is held back,
    and a matched stop string is never part of the text.

    The text is kept as the pieces already returned plus the pending tail not returned yet (what
    is held back, at most a stop string's length, and the newest piece), so each token costs work
    in proportion to its piece, not to the whole reply; `text` joins them when read.
    """

    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str] = ()):
        self.stop_ids = tokenizer.stop_ids
        self.stop_strings = [s for s in stop_strings if s]
        self.longest_stop = max(map(len, self.stop_strings), default=0)
        self.detok = StreamingDetokenizer(tokenizer)
        self._emitted: list[str] = []  # the text returned so far, in pieces
        self._pending = ""  # the text after it: held back, or not returned yet
        self.emitted = 0  # length of the text returned so far
        self.finish: str | None = None
        self.stop: str | None = None  # the stop string that ended generation, if any

    @property
    def text(self) -> str:
        """The text so far (without a matched stop string)."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return "".join(self._emitted) + self._pending

    def add(self, token_id: int) -> str:
        """Take the next generated id; return the text it made final (nothing once finished)."""
        if token_id in self.stop_ids:
            self.finish = "stop"
            return ""
        piece = self.detok.add(token_id)
        self._pending += piece
        stop, cut = self._find_stop(len(piece))
        if stop is not None:
            self._pending, self.finish, self.stop = self._pending[:cut], "stop", stop
            return ""
        return self._emit(len(self._pending) - self._held_back())

    def close(self) -> str:
        """The text not returned yet, once generation has ended."""
        if self.stop is None:
            self._pending += self.detok.flush()
        return self._emit(len(self._pending))

    def _emit(self, end: int) -> str:
        """Return the first `end` characters of the pending text, moving them to the returned text."""
        if end <= 0:
            return ""
        piece, self._pending = self._pending[:end], self._pending[end:]
        self._emitted.append(piece)
        self.emitted += end
        return piece

    def _find_stop(self, new: int) -> tuple[str | None, int]:
        # The text before the new piece held no stop string, so a match ends inside the piece; and
        # what was returned is no part of one (a match starting there would have been held back),
        # so it lies in the pending text. Searching only from where such a match could start keeps
        # long generations linear. The cut is an index into the pending text.
        start = max(0, len(self._pending) - new - self.longest_stop + 1)
        hits = [(i, s) for s in self.stop_strings if (i := self._pending.find(s, start)) >= 0]
        if not hits:
            return None, len(self._pending)
        cut, s = min(hits)
        return s, cut

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string.

        Such a tail lies in the pending text: it is what was held back before, plus the new piece.
        """
        longest = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(s[:n]):
                    longest = n
                    break
        return longest


class TextStream:
    """Generate and stream text; iterate for text pieces, then read `.result`.

    Stop strings are handled as `TextCollector` describes.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        cache: list[KVCache],
        prompt_ids: Sequence[int],
        sampler: Sampler,
        max_tokens: int,
        stop_strings: Sequence[str] = (),
        new_ids: Sequence[int] | None = None,
        guide: Guide | None = None,
        speculate: Callable[..., Iterator[int]] | None = None,
    ):
        """new_ids: the suffix of prompt_ids not yet in the cache (default: all of prompt_ids);
        guide: the constraint the output must match, if any; speculate: generate_tokens' stand-in
        that drafts (a bound speculative.speculative_tokens), if any."""
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        self.prompt_ids = list(prompt_ids)
        self.new_ids = self.prompt_ids if new_ids is None else list(new_ids)
        self.sampler, self.max_tokens = sampler, max_tokens
        self.stop_strings = [s for s in stop_strings if s]
        self.guide = guide
        self.speculate = speculate
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        history = self.prompt_ids[: len(self.prompt_ids) - len(self.new_ids)]
        collector = TextCollector(self.tokenizer, self.stop_strings)
        ids: list[int] = []
        start = time.perf_counter()
        first_token_time = None
        if self.speculate is not None:
            tokens = self.speculate(self.model, self.cache, self.new_ids, self.max_tokens, self.tokenizer.stop_ids,
                                    history, self.guide)
        else:
            tokens = generate_tokens(self.model, self.cache, self.new_ids, self.sampler, self.max_tokens,
                                     self.tokenizer.stop_ids, history, self.guide)
        for token_id in tokens:
            if first_token_time is None:
                first_token_time = time.perf_counter()
            ids.append(token_id)
            piece = collector.add(token_id)
            if piece:
                yield piece
            if collector.finish:
                break
        tail = collector.close()
        if tail:
            yield tail
        self.result = GenerationResult.of(collector, self.prompt_ids, ids, len(self.new_ids), start, first_token_time)
        if self.speculate is not None:
            self.result.drafted, self.result.accepted = self.speculate.drafted, self.speculate.accepted

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the cache held before the stream began (a prompt cache's prefix)."""
        return len(self.prompt_ids) - len(self.new_ids)

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        return self.result
