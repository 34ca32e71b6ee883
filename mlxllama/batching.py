"""Many prompts at once: batched decoding (`batch_generate`, `generate_batch`).

Each prompt is prefilled on its own, exactly as `Runtime.generate` prefills it
(prefill is already matrix-shaped work, and padding prompts to a common length would waste it),
and its cache then joins a BatchKVCache as a new row. Every decode step feeds one token per row in
a single forward pass: each row has its own RoPE position, its own cache length and a mask that
hides the slots past that length. A row keeps position p in slot p, as a lone sequence does, so
a row's logits are bit-identical to its one-at-a-time logits: on the CPU backend, matmuls and
attention give each row the same result whatever the batch around it, and masked slots add
exact zeros (tests/unit/test_batch.py checks the logits bit for bit, and the greedy ids). On MLX's
CUDA backend the step goes through the batched kernel (mlxllama.cuda) instead, whose float16
tensor-core products round each row's inputs differently from one sequence's kernel: there a
row's logits match its one-at-a-time logits within tests/cuda/test_cuda_step.py's tolerance. A finished
row leaves the batch at once, and a waiting prompt takes its place. Each row has its own
sampler, seeded from its own settings, so a row's output with a seed does not depend on the
batch it runs in.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterator, Sequence

import mlx.core as mx

from .cache import check_kv_size
from .constraints import Constraint, Guide
from .errors import MlxLlamaError
from .generate import GenerationResult, TextCollector, check_fits, prefill_chunk
from .models import Transformer
from .prompt_cache import PromptCache
from .sampling import SamplingParams, make_sampler
from .speculative import Backoff, Chooser, Drafting, verify
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Request:
    """One sequence to generate: its prompt ids and its own settings."""

    ids: Sequence[int]
    max_tokens: int = 256
    params: SamplingParams = SamplingParams()
    stop: Sequence[str] = ()
    # Log-probabilities of each generated token under the model, and of this many likeliest
    # alternatives (None: none); prompt_logprobs scores the prompt's tokens too (one forward pass).
    logprobs: int | None = None
    prompt_logprobs: bool = False
    # What the output must match (a JSON Schema, any JSON object, a regex or a grammar), if anything.
    constraint: Constraint | None = None
    # Speculative decoding: how this sequence is drafted for (prompt lookup or a draft model), if at all.
    drafting: Drafting | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (log-softmax of its logits), with the likeliest alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: mx.array, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """For logits [n, vocab] and the token that followed each row, its log-probability and the top alternatives."""
    logprobs = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(list(tokens), mx.uint32)[:, None], axis=-1)[:, 0].tolist()
    if top <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    best = mx.argsort(-logprobs, axis=-1)[:, :top]
    best_lp = mx.take_along_axis(logprobs, best, axis=-1)
    return [TokenLogprob(t, lp, tuple(zip(ids, lps))) for t, lp, ids, lps in
            zip(tokens, chosen, best.tolist(), best_lp.tolist())]


class Row:
    """A sequence being generated: its sampler, ids so far, text and timings."""

    def __init__(self, index, request: Request, tokenizer: Tokenizer, context_length: int | None, group=None,
                 max_kv_size: int = 0, keep: int = 0):
        self.index, self.request = index, request
        self.sampler = make_sampler(request.params, group)  # group: a split model's ranks (make_sampler)
        # With speculation every token is chosen by the Chooser (one random stream), drafted or not;
        # a draft model's cache is bounded as the row's own is.
        self.drafter = request.drafting.drafter(max_kv_size, keep) if request.drafting is not None else None
        self.chooser = Chooser(request.params) if request.drafting is not None else None
        self.backoff = Backoff()
        self.drafted = self.accepted = 0
        self.guide = Guide(request.constraint, tokenizer) if request.constraint is not None else None
        self.context = list(request.ids)  # what the repeat penalty looks back on
        self.ids: list[int] = []
        self.collector = TextCollector(tokenizer, request.stop)
        self.new_text = ""  # text made final since a caller last took it (take_text)
        self.logprobs: list[TokenLogprob] = []  # of the generated tokens, when the request asks
        self.prompt_logprobs: list[TokenLogprob] = []
        # Prompt tokens whose keys and values came from the prompt cache, and those fed through the model.
        self.cached_tokens = self.prefilled_tokens = 0
        self._logprobs_taken = self._ids_taken = 0
        self._result: GenerationResult | None = None
        # Like generate_tokens: never run past the model's context, unless the cache rotates (None).
        self.max_tokens = request.max_tokens if context_length is None else min(request.max_tokens,
                                                                                   context_length - len(request.ids))
        self.finished = self.max_tokens <= 0
        self.start = time.perf_counter()
        self.first_token_time: float | None = None

    @property
    def last_id(self) -> int:
        """The id its next step feeds: its last generated one, or, for a row that joined with its
        prompt's last token still to feed (BatchDecoder's stepped rests), that token."""
        return self.ids[-1] if self.ids else self.request.ids[-1]

    def accept(self, token_id: int, logits: mx.array | None = None) -> bool:
        """Record the next generated id (and its log-probability, from the logits it was sampled
        from, when the request asks); True once the row is finished."""
        if logits is not None and self.request.logprobs is not None:
            self.logprobs += token_logprobs(logits.reshape(1, -1), [token_id], self.request.logprobs)
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        if self.guide is not None:
            self.guide.accept(token_id)
        self.ids.append(token_id)
        self.context.append(token_id)
        self.new_text += self.collector.add(token_id)
        self.finished = self.collector.finish is not None or len(self.ids) >= self.max_tokens
        return self.finished

    def allowed(self, n_logits: int) -> mx.array | None:
        """The mask of tokens the row's constraint allows next (None: no constraint)."""
        return self.guide.allowed(n_logits) if self.guide is not None else None

    def choose(self, logits: mx.array) -> int:
        """The next token from the logits after the row's ids (a speculating row's Chooser decides it)."""
        allowed = self.allowed(logits.shape[-1])
        if self.chooser is not None:
            return self.chooser.pick(logits, self.context, Counter(self.ids), allowed)
        return self.sampler(logits, self.context, allowed=allowed).item()

    def propose(self) -> tuple[list[int], list]:
        """Drafts to check after the row's last id, and the drafter's distribution at each (none
        without speculation, with no room left, or while the drafter rests: speculative.Backoff)."""
        room = min(self.request.drafting.k, self.max_tokens - len(self.ids)) if self.drafter is not None else 0
        if room <= 0 or self.backoff.rests():
            return [], []
        drafts, qs = self.drafter.propose(self.context, room, self.chooser, self.guide)
        self.backoff.proposed(drafts)
        self.backoff.rests()  # this step is the rest's first
        return drafts, qs

    @property
    def pipelines(self) -> bool:
        """Whether the row's next token may be chosen on the device and read a step later (BatchDecoder's
        pipelined step): no constraint or log-probabilities, and no drafts to check unless its drafter
        rests and its choice is a plain argmax, as the sampler's."""
        return (self.guide is None and self.request.logprobs is None
                and (self.drafter is None or self.backoff.rest > 0 and self.request.params.plain_greedy))

    def take_text(self) -> str:
        text, self.new_text = self.new_text, ""
        return text

    def take_ids(self) -> list[int]:
        """The generated ids not taken before."""
        taken, self._ids_taken = self._ids_taken, len(self.ids)
        return self.ids[taken:]

    def take_logprobs(self) -> list[TokenLogprob]:
        """The generated tokens' log-probabilities not taken before."""
        taken, self._logprobs_taken = self._logprobs_taken, len(self.logprobs)
        return self.logprobs[taken:]

    def result(self) -> GenerationResult:
        """The finished row's result (its text closed: what was held back for stop strings is final)."""
        if self._result is None:
            self.new_text += self.collector.close()
            self._result = GenerationResult.of(self.collector, self.request.ids, self.ids, len(self.request.ids),
                                               self.start, self.first_token_time)
            self._result.drafted, self._result.accepted = self.drafted, self.accepted
        return self._result


@dataclass
class Joining:
    """A row whose prompt is being prefilled, a chunk at a time, into a cache of its own."""

    row: Row
    cache: list
    fed: int = 0

    def fed_through(self, n: int) -> None:
        """n more of the prompt's tokens went through the model (not from the prompt cache)."""
        self.fed += n
        self.row.prefilled_tokens += n


# With `stepped_rests`, a rest of at most this many tokens after a cached prefix (a prompt the prompt
# cache holds but for its last token or two) is fed one decode step a token, its last in the batch's
# next step: on an H100 a prefill pass of a few tokens took about 10 ms of MLX's host time, a step
# of the CUDA kernels about 1 ms.
STEPPED_REST_MAX = 4


class BatchDecoder:
    """Rows that join and leave between decode steps (continuous batching): one forward pass a
    step for every row, each at its own position. The engine of generate_batch and of the server.

    A request joins in two moves: admit() queues it, and prefill_chunk() feeds its prompt one
    chunk at a time (`chunk` ids, by default as generate's prefill), so a caller that runs a
    decode step between chunks never stalls the running rows for more than one chunk.

    With `group`, several joining prompts whose rests fit in one chunk together are fed in one
    forward pass (a burst of requests then waits for one pass, not one a request), each row
    padded on the right to the longest, which its causal mask keeps it from seeing. A lone joiner
    is fed alone, exactly as generate feeds it; in a group a row's logits differ from its lone
    ones by rounding (other shapes), within tests/unit/test_batch.py's bound. The server groups
    on the CPU only: MLX's CUDA backend compiles every new shape of a group (docs/server.md).

    With `stepped_rests`, a short rest after a cached prefix goes through the decode step instead
    of a prefill pass (STEPPED_REST_MAX), and its last token through the batch's next step, where
    the row's first token is sampled with the others': every such joiner in the queue joins in one
    prefill_chunk(), so a burst of repeated prompts waits for one step, not one a request. The
    server does so on a GPU.

    Rows whose request drafts (speculative decoding) each propose up to k tokens a step; the step
    then feeds every row its last id and its drafts in one pass, and cuts each row's cache to what
    its model kept, so rows keep drafting, rejecting and plain decoding side by side.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, batch_size: int = 8, chunk: int | None = None,
                 prompt_cache: PromptCache | None = None, max_kv_size: int = 0, keep: int = 0, group: bool = False,
                 stepped_rests: bool = False, draft_room: int = 0):
        if batch_size < 1:
            raise MlxLlamaError("the batch size must be at least 1")
        check_kv_size(max_kv_size, keep, model.kv_quantization)
        self.model, self.tokenizer, self.batch_size, self.chunk = model, tokenizer, batch_size, chunk or prefill_chunk()
        # A ring's rows take one token at a time (cache.RingKVCache): no groups with a max_kv_size.
        self.group = group and not max_kv_size
        self.stepped_rests = stepped_rests
        # Where prompts start from keys and values computed before, and where finished rows leave theirs.
        self.prompt_cache = prompt_cache
        # With a max_kv_size every row keeps its first `keep` and its last positions (cache.RingKVCache),
        # and may run past the context: no context to stop at (None).
        self.max_kv_size, self.keep = max_kv_size, keep
        self.context = None if max_kv_size else model.config.context_length
        # A ring holds `draft_room` slots past each row's window for speculative decoding's drafts:
        # no row may draft more at a time (a growing cache has room for any number).
        self.draft_room = draft_room
        self.cache = model.make_batch_cache(max_kv_size, keep, draft_room)
        self.rows: list[Row] = []
        self.joining: deque[Joining] = deque()
        # Pipelined steps (step): each row's next input, on the device (None: each row's last id),
        # and whether the host has yet to read it (a token sampled by the last step).
        self.inputs: mx.array | None = None
        self.unread: list[bool] = []

    @property
    def room(self) -> int:
        return self.batch_size - len(self.rows) - len(self.joining)

    def admit(self, index, request: Request) -> Row:
        """Queue a request to join; a row with nothing to generate is finished at once (row.finished)."""
        check_fits(len(request.ids), self.context)
        if request.drafting is not None and self.max_kv_size and request.drafting.k > self.draft_room:
            raise MlxLlamaError(f"with --max-kv-size, a row drafts at most {self.draft_room} tokens at a time here")
        row = Row(index, request, self.tokenizer, self.context, self.model.sampling_group, self.max_kv_size, self.keep)
        if request.prompt_logprobs:
            logits = self.model(mx.array([list(request.ids)]))[0]  # one fresh pass, as Runtime.logits
            row.prompt_logprobs = token_logprobs(logits[:-1], request.ids[1:], request.logprobs or 0)
        if row.finished:
            return row
        # A joining row's cache keeps every position in its slot, as the batch's rows do (a sliding
        # layer's too: the batch masks what lies outside its window); a ring takes any kind.
        bounds = dict(bounded=bool(self.max_kv_size), max_kv_size=self.max_kv_size, keep=self.keep)
        entry, cached = self.prompt_cache.lookup(request.ids) if self.prompt_cache else (None, 0)
        if entry is not None:
            self.joining.append(Joining(row, self.prompt_cache.restore(entry, cached, self.model, **bounds), cached))
            row.cached_tokens = cached
        else:
            self.joining.append(Joining(row, self.model.make_cache(**bounds)))
        return row

    def prefill_chunk(self) -> list[Row]:
        """Feed the next chunk of the first joining prompt (or, grouping, the rest of the first few
        prompts together). Once a whole prompt is in, its first token is sampled and the row joins
        the batch; the rows that token finished are returned. With stepped rests, every joiner whose
        rest is stepped joins first, and alone: their first tokens come with the next step."""
        stepped = [j for j in self.joining if self._steps_in(j)]
        if stepped:
            self.joining = deque(j for j in self.joining if not self._steps_in(j))
            for joining in stepped:
                self._step_in(joining)
            self._join(stepped)
            return []
        group = self._group()
        if len(group) > 1:
            return self._prefill_group(group)
        joining = self.joining[0]
        ids = joining.row.request.ids
        chunk = ids[joining.fed : joining.fed + self.chunk]
        hidden = self.model.hidden_states(mx.array([chunk]), joining.cache)
        joining.fed_through(len(chunk))
        if joining.fed < len(ids):
            mx.eval([c.state for c in joining.cache])
            return []
        self.joining.popleft()
        return self._joined([joining], [self.model.head(hidden[:, -1:])[0, -1]])

    def _steps_in(self, joining: Joining) -> bool:
        rest = len(joining.row.request.ids) - joining.fed
        return self.stepped_rests and 0 < joining.fed and rest <= STEPPED_REST_MAX

    def _step_in(self, joining: Joining) -> None:
        """A joiner's short rest after its cached prefix fed one token a decode step (model.step:
        the CUDA kernels where they run), as a sequence's generated tokens are, but for its last,
        which the batch's next step feeds (Row.last_id) and samples its first token from; the
        caller joins it to the batch."""
        ids = joining.row.request.ids
        for token in ids[joining.fed : -1]:
            self.model.step(mx.array([[token]]), joining.cache)
        joining.fed_through(len(ids) - joining.fed)

    def _group(self) -> list[Joining]:
        """The joining prompts at the front of the queue (a prefix of it) whose rests, padded to the
        longest, fit in one chunk together: fed in one pass when more than one."""
        if not self.group:
            return []
        group: list[Joining] = []
        width = 0
        for joining in self.joining:
            rest = len(joining.row.request.ids) - joining.fed
            wider = max(width, rest)
            if wider * (len(group) + 1) > self.chunk:
                break
            group.append(joining)
            width = wider
        return group

    def _prefill_group(self, group: list[Joining]) -> list[Row]:
        """The rests of `group`'s prompts in one pass: each row continues its own cache (empty, or
        a prompt cache's prefix) as a row of a batch cache, right-padded to the common width."""
        rests = [list(j.row.request.ids[j.fed :]) for j in group]
        width = max(map(len, rests))
        cache = self.model.make_batch_cache()
        lengths = [j.fed + len(rest) for j, rest in zip(group, rests)]
        for i, layer in enumerate(cache):
            layer.extend([joining.cache[i] for joining in group])
            layer.padded(lengths)
        pad = self.tokenizer.eos_id if self.tokenizer.eos_id is not None else 0
        hidden = self.model.hidden_states(mx.array([rest + [pad] * (width - len(rest)) for rest in rests]), cache)
        for layer in cache:
            layer.cut_rows(lengths)
        last = mx.stack([hidden[i, len(rest) - 1] for i, rest in enumerate(rests)])
        logits = self.model.head(last)
        for i, (joining, rest) in enumerate(zip(group, rests)):
            self.joining.popleft()  # the group is the queue's front
            joining.fed_through(len(rest))
            joining.cache = [layer.single(i) for layer in cache]
        return self._joined(group, list(logits))

    def _joined(self, joined: list[Joining], logits: list[mx.array]) -> list[Row]:
        """Prompts all fed, logits[i] the last position's of joined[i]: each stored and its first
        token sampled; those it did not finish join the batch, together. The rows it finished."""
        finished, staying = [], []
        for joiner, last in zip(joined, logits):
            ids = joiner.row.request.ids
            if self.prompt_cache is not None and all(c.start == 0 for c in joiner.cache):  # none dropped: in order
                self.prompt_cache.store(ids, [(c.keys, c.values) for c in joiner.cache],
                                        copies=[c.copies for c in joiner.cache])
            row = joiner.row
            (finished if row.accept(row.choose(last), last) else staying).append(joiner)
        self._join(staying)
        return [joiner.row for joiner in finished]

    def _join(self, joined: list[Joining]) -> None:
        """The rows and their caches into the batch, each copied once (BatchKVCache.extend): each
        row's next input is its last id, which the host has."""
        if not joined:
            return
        for i, layer in enumerate(self.cache):
            layer.extend([joiner.cache[i] for joiner in joined])
        self.rows += [joiner.row for joiner in joined]
        if self.inputs is not None:
            ids = mx.array([joiner.row.last_id for joiner in joined], self.inputs.dtype)
            self.inputs = mx.concatenate([self.inputs, ids])
        self.unread += [False] * len(joined)

    def step(self) -> list[Row]:
        """One decode step of every row (with speculation, a check of each row's drafts: up to k + 1
        tokens a row); the rows it finished, which have left the batch.

        Where no row needs its last token on the host before the next step (no constraint, drafts
        or log-probabilities), steps are pipelined as generate's loop is: a step feeds each row the
        token the previous step sampled, still on the device, and queues the next sampling before
        the host reads that token, so the host's work overlaps the device's. A row then learns of
        a token one call later, and a token that finishes it has been fed (one position more,
        never seen: the row leaves)."""
        if not self.rows:
            return []
        if self._pipelines():
            return self._leave(self._pipelined_step())
        finished = self._leave(self._read_inputs())  # the tokens the pipeline left unread, first
        if not self.rows:
            return finished
        proposals = [row.propose() for row in self.rows]
        done = self._checked_step(proposals) if any(drafts for drafts, _ in proposals) else self._plain_step()
        return finished + self._leave(done)

    def _pipelines(self) -> bool:
        return self.model.shard is None and all(row.pipelines for row in self.rows)

    def _pipelined_step(self) -> list[bool]:
        """Feed each row its next input (the previous step's token, unread, or its last id), queue
        the sampling of the token after it, then read the inputs: whether each row finished."""
        inputs = self.inputs if self.inputs is not None else mx.array([row.last_id for row in self.rows])
        logits = self.model.step(inputs[:, None], self.cache)
        for row in self.rows:
            row.backoff.rests()
        # The repeat penalty sees a fed token the host has not read yet as `pending`.
        self.inputs = mx.stack([row.sampler(logits[i], row.context, inputs[i] if self.unread[i] else None)
                                for i, row in enumerate(self.rows)])
        mx.async_eval(self.inputs)
        unread, self.unread = self.unread, [True] * len(self.rows)
        return self._take(inputs, unread)

    def _read_inputs(self) -> list[bool]:
        """The tokens the last pipelined step sampled, read and taken by their rows, which will feed
        them from the host: whether each row finished."""
        if self.inputs is None:
            return [False] * len(self.rows)
        inputs, unread = self.inputs, self.unread
        self.inputs, self.unread = None, [False] * len(self.rows)
        return self._take(inputs, unread)

    def _take(self, tokens: mx.array, unread: list[bool]) -> list[bool]:
        """Each row takes its token that the host had not read (waiting for it): whether it finished."""
        ids = tokens.tolist()
        return [unread[i] and row.accept(ids[i]) for i, row in enumerate(self.rows)]

    def _leave(self, done: list[bool]) -> list[Row]:
        """The rows `done` marks finished: stored in the prompt cache (what they fed, but their last
        token) and taken out of the batch."""
        finished = [row for row, d in zip(self.rows, done) if d]
        if finished and self.prompt_cache is not None:
            for i, row in enumerate(self.rows):
                if not done[i]:
                    continue
                held = list(row.request.ids) + row.ids[:-1]  # the prompt and every generated token but the last
                if all(c.in_order(len(held)) for c in self.cache):
                    self.prompt_cache.store(held, [c.row(i) for c in self.cache],
                                            copies=[c.row_copies(i) for c in self.cache])
        if finished:
            self.drop(finished)
        return finished

    def _plain_step(self) -> list[bool]:
        """Each row's last id fed and its next token chosen; whether each row finished."""
        logits = self.model.step(mx.array([[row.last_id] for row in self.rows]), self.cache)
        if any(row.guide is not None for row in self.rows):
            mx.async_eval(logits)  # the constraints' masks are built on the host while the device runs the step
        if any(row.chooser is not None for row in self.rows):
            tokens = [row.choose(logits[i]) for i, row in enumerate(self.rows)]
        else:
            allowed = [row.allowed(logits.shape[-1]) for row in self.rows]
            tokens = mx.stack([row.sampler(logits[i], row.context, allowed=allowed[i])
                               for i, row in enumerate(self.rows)]).tolist()
        # A row's logits go with its token only where the request asked for log-probabilities.
        return [row.accept(token, logits[i] if row.request.logprobs is not None else None)
                for i, (row, token) in enumerate(zip(self.rows, tokens))]

    def _checked_step(self, proposals: list[tuple[list[int], list]]) -> list[bool]:
        """Speculation's step: each row's last id and its drafts in one pass (rows padded on the
        right to the most drafts, which their causal masks keep from the real positions), the
        drafts each row's model keeps and its own token after them, and each row's cache cut to
        what it kept; whether each row finished."""
        width = 1 + max(len(drafts) for drafts, _ in proposals)
        tokens = [[row.last_id] + drafts + [row.last_id] * (width - 1 - len(drafts))
                  for row, (drafts, _) in zip(self.rows, proposals)]
        before = list(self.cache[0].lengths)
        for layer in self.cache:
            layer.padded([n + 1 + len(drafts) for n, (drafts, _) in zip(before, proposals)])
        logits = self.model.check_drafts(mx.array(tokens), self.cache)
        done, lengths = [], []
        for i, (row, (drafts, qs)) in enumerate(zip(self.rows, proposals)):
            if row.drafter is None:
                emitted = [row.choose(logits[i, 0])]
            else:
                accepted, following = verify(row.chooser, logits[i], drafts, qs, row.context, Counter(row.ids),
                                             row.guide)
                row.drafted, row.accepted = row.drafted + len(drafts), row.accepted + len(accepted)
                emitted = accepted + [following]
            lengths.append(before[i] + len(emitted))  # the last id and the kept drafts were fed; not the new token
            # Taken in order until one finishes the row (any() stops there).
            done.append(any(row.accept(token, logits[i, j] if row.request.logprobs is not None else None)
                            for j, token in enumerate(emitted)))
        for layer in self.cache:
            layer.cut_rows(lengths)
        return done

    def drop(self, rows: Sequence[Row]) -> None:
        """Take rows out of the batch or the queue to join (finished, or their caller went away),
        freeing their cache."""
        gone = {id(row) for row in rows}
        self.joining = deque(j for j in self.joining if id(j.row) not in gone)
        keep = [i for i, row in enumerate(self.rows) if id(row) not in gone]
        if len(keep) < len(self.rows):
            self.rows = [self.rows[i] for i in keep]
            for layer in self.cache:
                layer.keep_rows(keep)
            self.unread = [self.unread[i] for i in keep]
            if self.inputs is not None:
                self.inputs = self.inputs[mx.array(keep, mx.int32)] if keep else None


def generate_batch(model: Transformer, tokenizer: Tokenizer, requests: Sequence[Request], batch_size: int = 8,
                   prompt_cache: PromptCache | None = None, max_kv_size: int = 0,
                   keep: int = 0) -> Iterator[list[tuple[int, GenerationResult]]]:
    """Generate every request, up to batch_size rows per decode step, admitting requests in order
    (a prompt that starts as one in `prompt_cache` prefills only the rest).

    After each step, yields the requests that finished in it as (index in requests, result),
    often none, so a caller can write results as they come and stop cleanly between steps.
    """
    draft_room = max((r.drafting.k for r in requests if r.drafting is not None), default=0)
    decoder = BatchDecoder(model, tokenizer, batch_size, prompt_cache=prompt_cache, max_kv_size=max_kv_size, keep=keep,
                           draft_room=draft_room)
    for request in requests:
        check_fits(len(request.ids), decoder.context)
    waiting = deque(enumerate(requests))
    while decoder.rows or waiting:
        finished = []
        while waiting and decoder.room:
            row = decoder.admit(*waiting.popleft())
            if row.finished:
                finished.append(row)
        while decoder.joining:  # all the way in before the step: there is no stream to keep moving here
            finished += decoder.prefill_chunk()
        finished += decoder.step()
        yield [(row.index, row.result()) for row in finished]


def batch_generate(runtime, prompts: Sequence[str | Sequence[int] | Request], max_tokens: int = 256,
                   params: SamplingParams = SamplingParams(), stop: Sequence[str] = (), batch_size: int = 8,
                   special: bool = False, constraint: Constraint | None = None, max_kv_size: int = 0, keep: int = 4,
                   draft=None, draft_tokens: int = 4, **sampling) -> list[GenerationResult]:
    """Generate for many prompts with batched decoding; the results come in prompt order.

    runtime is what `mlxllama.load` returns. A prompt is a string (tokenized with BOS and no
    template; `special` parses control tokens in it), a list of token ids, or a Request with
    settings of its own (the other settings apply to the others). Sampling keywords (the fields of
    SamplingParams) override `params`. With temperature 0 and no repeat penalty each result's ids
    equal `runtime.generate`'s for that prompt. A `max_kv_size` bounds every row's cache to its
    first `keep` and last positions, as it bounds `runtime.generate`'s. `draft` turns on speculative
    decoding for every row, as `runtime.generate`'s does: another loaded model of the same vocabulary
    (one model, a cache a row) or an int n for prompt lookup; each result says what was drafted and
    accepted.
    """
    params = params.with_overrides(**sampling)
    drafting = runtime.drafting(draft, draft_tokens) if draft is not None else None

    def request(prompt) -> Request:
        if isinstance(prompt, Request):
            return prompt
        ids = runtime.tokenize(prompt, special=special) if isinstance(prompt, str) else list(prompt)
        return Request(ids, max_tokens, params, tuple(stop), constraint=constraint, drafting=drafting)

    results: list[GenerationResult | None] = [None] * len(prompts)
    for finished in generate_batch(runtime.model, runtime.tokenizer, [request(p) for p in prompts], batch_size,
                                   max_kv_size=max_kv_size, keep=keep):
        for index, result in finished:
            results[index] = result
    return results
