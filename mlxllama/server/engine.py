"""The server's generation engine: one thread that runs every request through one BatchDecoder.

Requests join the running batch at the next step (continuous batching) and leave it when done or
when their client goes away. The thread hands each request's text to its caller as it becomes
final, through a callback that the caller makes safe for its own thread (app.py posts to the event
loop). engine_process.py runs this engine in a process of its own, with the same face to the app.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from ..batching import BatchDecoder, Request, Row, TokenLogprob
from ..cache import grown_size, kv_bytes_per_position, kv_label, ring_slots
from ..generate import PREFILL_CHUNK, GenerationResult
from ..prompt_cache import PromptCache
from .replicas import LeadingDecoder


@dataclass(frozen=True)
class Finished:
    """A finished request as its caller reads it: a record of plain values, since it crosses to the
    caller's thread (or process) while the engine goes on with the row's batch."""

    result: GenerationResult
    ids: list[int]
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob]
    cached_tokens: int  # prompt tokens whose keys and values came from the prompt cache
    prefilled_tokens: int  # prompt tokens fed through the model
    speculative: bool  # drafted for: the result's drafted and accepted counts mean something

    @classmethod
    def of(cls, row: Row) -> Finished:
        return cls(row.result(), list(row.ids), list(row.logprobs), list(row.prompt_logprobs), row.cached_tokens,
                   row.prefilled_tokens, row.drafter is not None)


@dataclass
class Ticket:
    """One request in the engine: `on_text((piece, logprobs, ids))` as tokens come (the text they
    made final, their log-probabilities when asked for, their ids), then `on_done(Finished)` or
    `on_error(exception)`, all called from the engine's thread."""

    request: Request
    on_text: Callable[[tuple[str, list, list[int]]], None]
    on_done: Callable[[Finished], None]
    on_error: Callable[[BaseException], None]
    cancelled: bool = False
    row: Row | None = field(default=None, repr=False)
    # Set by an engine that must be told (engine_process.py's): called once, by the first cancel().
    on_cancel: Callable[[], None] | None = field(default=None, repr=False)

    def cancel(self) -> None:
        """The caller went away: the row leaves the batch at the next step."""
        if not self.cancelled and self.on_cancel is not None:
            self.on_cancel()
        self.cancelled = True


class Overloaded(Exception):
    """The queue of waiting requests is full: the caller should answer 503 and say when to retry."""


class TooLarge(Exception):
    """A request whose KV cache alone would exceed the memory budget: it could never run."""


@dataclass(frozen=True)
class KvBudget:
    """The bytes of the batch's KV cache, against the budget they must stay within."""

    budget: int
    slot_bytes: int  # one position of one row, every layer
    context_length: int
    max_kv_size: int  # a ring's positions a row (0: the cache grows)
    draft_room: int
    ring_slots: int = 0  # the slots a ring's row holds (cache.ring_slots)

    def bytes(self, rows: int, slots: int) -> int:
        """The batch cache's bytes for `rows` rows of `slots` positions (rounded up as it grows; a
        ring's rows hold its slots, however many they need)."""
        if self.max_kv_size:
            return rows * self.ring_slots * self.slot_bytes
        return rows * grown_size(min(slots, self.context_length)) * self.slot_bytes

    @staticmethod
    def need(request: Request) -> int:
        return len(request.ids) + request.max_tokens

    def check(self, request: Request) -> None:
        """TooLarge for a request that could not run even alone."""
        alone = self.bytes(1, self.need(request))
        if alone > self.budget:
            raise TooLarge(f"the request's KV cache ({alone >> 20} MiB) would exceed the server's budget of"
                           f" {self.budget >> 20} MiB; ask for fewer max_tokens")


class Engine:
    """Every request through one BatchDecoder, within a memory budget for the KV cache.

    The batch's cache holds every row at the longest row's capacity, so a request is admitted only
    while (rows + 1) x the longest need stays within `kv_budget` bytes (a need: prompt plus
    max_tokens, in the cache's growth steps); the others wait, at most `max_queue` of them, and past
    that submit() raises Overloaded. `handed_on`, if given, is called after each group of calls to
    the tickets' callbacks that belong together (a prefill's first tokens, a step's tokens): a
    caller that buffers them sends them on then.
    """

    def __init__(self, runtime, max_batch: int = 16, prefill_chunk: int = PREFILL_CHUNK,
                 kv_budget: int | None = None, max_queue: int = 64, prompt_cache_bytes: int = 0,
                 max_kv_size: int = 0, keep: int = 4, draft_room: int = 0,
                 handed_on: Callable[[], None] | None = None):
        decoder = make_decoder(runtime, max_batch, prefill_chunk, prompt_cache_bytes, max_kv_size, keep, draft_room)
        self.prompt_cache = decoder.prompt_cache
        # A model split over mlx.launch's ranks: each decoder call goes to the other ranks first.
        self.decoder = LeadingDecoder(decoder) if runtime.model.shard else decoder
        model = runtime.model
        self.sharded = model.shard is not None
        self.kv_cache_label = kv_label(model.kv_quantization)
        self.dtype = model.compute_dtype_name
        self.budget = KvBudget(kv_budget if kv_budget is not None else default_kv_budget(),
                               kv_bytes_per_position(runtime.config, model.compute_dtype, model.kv_quantization),
                               runtime.config.context_length, decoder.max_kv_size, decoder.draft_room,
                               ring_slots(decoder.max_kv_size, keep, model.kv_quantization, decoder.draft_room)
                               if decoder.max_kv_size else 0)
        self.max_queue = max_queue
        self.handed_on = handed_on or (lambda: None)
        self.inbox: queue.Queue[Ticket | None] = queue.Queue()
        self.waiting: deque[Ticket] = deque()
        self.tickets: list[Ticket] = []
        self.thread = threading.Thread(target=self._run, name="mlxllama-engine", daemon=True)
        self.thread.start()

    @property
    def context(self) -> int | None:
        """The most positions a prompt and its reply may take (None: a rotating cache, no bound)."""
        return self.decoder.context

    @property
    def running(self) -> int:
        """Requests in the batch now."""
        return len(self.tickets)

    @property
    def waiting_count(self) -> int:
        """Requests submitted and not yet in the batch."""
        return self.inbox.qsize() + len(self.waiting)

    async def health(self) -> dict:
        """What GET /health reports of the engine."""
        return self.report()

    def report(self) -> dict:
        return {"requests_running": self.running, "requests_waiting": self.waiting_count,
                "active_memory_bytes": mx.get_active_memory(),
                "prompt_cache_bytes": self.prompt_cache.nbytes if self.prompt_cache else 0,
                "kv_cache": self.kv_cache_label, "dtype": self.dtype, "max_kv_size": self.budget.max_kv_size,
                "engine_pid": os.getpid()}

    def submit(self, ticket: Ticket) -> Ticket:
        self.budget.check(ticket.request)
        if self.waiting_count >= self.max_queue:
            raise Overloaded(f"{self.max_queue} requests are already waiting")
        self.inbox.put(ticket)
        return ticket

    def stop(self) -> None:
        self.inbox.put(None)
        self.thread.join(timeout=30)

    def _run(self) -> None:
        self._serve()
        if isinstance(self.decoder, LeadingDecoder):
            self.decoder.close()
        for ticket in self.tickets + list(self.waiting):
            with contextlib.suppress(RuntimeError):  # its event loop may be closed already
                ticket.on_error(RuntimeError("the server is stopping"))
        self.handed_on()

    def _serve(self) -> None:
        while True:
            if not self._admit():
                return
            self._drop_cancelled()
            try:
                # One chunk of a joining prompt (or of a few short ones together), then one step of
                # the running rows: a newcomer's prefill holds the running streams up by one chunk at most.
                finished = []
                if self.decoder.joining:
                    finished = self.decoder.prefill_chunk()
                    # A prompt all fed has its first token now: it goes out before the step, not after.
                    for ticket in self.tickets:
                        self._hand_on(ticket)
                    self.handed_on()
                finished += self.decoder.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
                for ticket in self.tickets:
                    ticket.on_error(e)
                self.handed_on()
                self.decoder.drop([t.row for t in self.tickets])
                self.tickets = []
                continue
            for ticket in self.tickets:
                self._hand_on(ticket)
            for ticket in [t for t in self.tickets if t.row in finished]:
                self._finish(ticket)
            self.handed_on()

    def _admit(self) -> bool:
        """Move new requests to the waiting line (waiting for one when nothing runs), then admit
        from its front while the batch has room and the budget allows; False to stop."""
        while True:
            try:
                ticket = self.inbox.get(block=not self.tickets and not self.waiting)
            except queue.Empty:
                break
            if ticket is None:
                return False
            self.waiting.append(ticket)
        while self.waiting and self.decoder.room:
            ticket = self.waiting[0]
            if ticket.cancelled:
                self.waiting.popleft()
                continue
            longest = max([self.budget.need(t.request) for t in self.tickets] + [self.budget.need(ticket.request)])
            if self.tickets and self.budget.bytes(len(self.tickets) + 1, longest) > self.budget.budget:
                break  # it waits for rows to finish
            self.waiting.popleft()
            try:
                ticket.row = self.decoder.admit(id(ticket), ticket.request)
            except Exception as e:  # noqa: BLE001 - reported to that request alone
                ticket.on_error(e)
                continue
            self._hand_on(ticket)
            self.tickets.append(ticket)
            if ticket.row.finished:
                self._finish(ticket)
        return True

    def _finish(self, ticket: Ticket) -> None:
        self.tickets.remove(ticket)
        finished = Finished.of(ticket.row)  # closes the text: what was held back for stop strings is final now
        self._hand_on(ticket)
        ticket.on_done(finished)

    @staticmethod
    def _hand_on(ticket: Ticket) -> None:
        text, logprobs, ids = ticket.row.take_text(), ticket.row.take_logprobs(), ticket.row.take_ids()
        if text or logprobs or ids:
            ticket.on_text((text, logprobs, ids))

    def _drop_cancelled(self) -> None:
        gone = [t for t in self.tickets if t.cancelled]
        if gone:
            self.decoder.drop([t.row for t in gone])
            self.tickets = [t for t in self.tickets if not t.cancelled]


def make_decoder(runtime, max_batch: int = 16, prefill_chunk: int = PREFILL_CHUNK, prompt_cache_bytes: int = 0,
                 max_kv_size: int = 0, keep: int = 4, draft_room: int = 0) -> BatchDecoder:
    """The engine's decoder (and a following rank's: replicas.follow). A pipeline's ranks hold
    caches of different sizes, so their prompt caches would drop different entries and their
    decoders part ways: a pipeline keeps none."""
    shard = runtime.model.shard
    if shard is not None and shard.mode == "pipeline":
        prompt_cache_bytes = 0
    prompt_cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes else None
    # Joiners prefilled together: on the CPU a burst's TTFT p95 fell by half; on an H100 each new
    # shape of a group compiled anew (0.2 s to 99 s) and the server did worse (docs/server.md).
    # There a cached prompt's last tokens go through the decode step's kernels instead.
    gpu = mx.default_device() == mx.gpu
    if gpu:
        warm_up(BatchDecoder(runtime.model, runtime.tokenizer, max_batch, prefill_chunk, None, max_kv_size, keep))
    return BatchDecoder(runtime.model, runtime.tokenizer, max_batch, prefill_chunk, prompt_cache, max_kv_size, keep,
                        group=not gpu, stepped_rests=gpu, draft_room=draft_room)


def warm_up(decoder: BatchDecoder) -> None:
    """Run a few tokens through `decoder` (a throwaway one) at 1, 2, 4 ... and the most rows, then
    prefill prompts of 2, 3, 5, 9 ... tokens up to just past one chunk, so that what MLX's CUDA
    backend loads or compiles on first use happens before the first request rather than during one.
    On an H100 each batch size class of the CUDA kernels took 4-8 s to compile; a prefill of more
    than 32 rows, the first on a machine, 82 s; and in a fresh process each new class of prefill
    rows about 260 ms, which a lone client's TTFT p95 was (docs/benchmarks.md). Its prompts of two
    tokens, one a row, meet that prefill shape again, which loads cuDNN's fused attention for CUDA's
    prefill (1.2 s on an H200: Transformer.attend_prefill). Every rank of a split model runs it alike."""
    sizes = sorted({1 << i for i in range(decoder.batch_size.bit_length())} | {decoder.batch_size})
    prompt = [decoder.tokenizer.bos_id or 0] * 2
    for size in sizes:
        for index in range(size):
            decoder.admit(index, Request(prompt, 2))
        while decoder.joining:
            decoder.prefill_chunk()
        while decoder.rows:
            decoder.step()
    for length in prefill_ladder(decoder.chunk):
        if decoder.context is not None and length > decoder.context:
            break
        decoder.admit(0, Request(prompt[:1] * length, 1))  # finished by its first token: it never steps
        while decoder.joining:
            decoder.prefill_chunk()


def prefill_ladder(chunk: int) -> list[int]:
    """Prompt lengths with one in every power-of-two class of rows up to a chunk, and one past it."""
    return [(1 << k) + 1 for k in range(chunk.bit_length())]


def default_kv_budget() -> int:
    """Half the device's memory where MLX reports it (a GPU), else a quarter of the machine's."""
    info = mx.device_info()
    total = info.get("memory_size") or info.get("total_memory")
    if total:
        return int(total) // 2
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
