"""The engine in a process of its own (`mlxllama serve --engine process`).

With the engine's thread in the server's process, the event loop and the engine take turns at one
interpreter lock. On an H100 at 16 clients a probe of that lock waited over a millisecond 180 times,
at either side's work, and a stand-in engine that held no interpreter served the same burst with
half the TTFT p95 (docs/benchmarks.md). Here engine.py's Engine runs unchanged in a spawned process
that loads the model; the server's process keeps the HTTP side, the templates and the tokenizer,
reading the file's metadata and no weights. One pipe joins them: requests, cancellations and
health questions go down; each engine turn's events come up as one message.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from dataclasses import dataclass, field, replace
from typing import Callable

from ..batching import Request
from ..cache import KVQuantization
from ..errors import MlxLlamaError
from .engine import Engine, Overloaded, Ticket

# A request's drafting by the server's draft model (--draft-model) names it so: the model is the
# engine process's, loaded there, and a Transformer does not cross a pipe.
ENGINE_DRAFT_MODEL = "the engine process's draft model"
# How long /health waits for the engine's process to answer: it answers between two steps.
HEALTH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class EngineSpec:
    """What the engine's process loads (runtime.load's settings, and a draft model) and the Engine
    it runs (Engine's keyword arguments but max_queue, which the server's side keeps)."""

    path: str
    dequantize: bool = False
    dtype: str | None = None  # --dtype's name, which runtime.load takes: an mx.Dtype does not pickle
    context_length: int | None = None
    kv_quantization: KVQuantization | None = None
    draft_path: str | None = None
    draft_tokens: int = 4
    engine: dict = field(default_factory=dict)


class EngineLost(RuntimeError):
    """The engine's process ended while the server ran."""


class EngineProcess:
    """Engine's face to the app (submit, health, budget, context, sharded), over a spawned process
    that runs the Engine. The constructor returns once the model is loaded and warmed up there, or
    raises MlxLlamaError with the process's one-line reason. `on_lost(message)` (serve sets it) is
    called, from a thread of this class, if the process ends before stop()."""

    sharded = False  # a model split over mlx.launch's ranks runs in their processes: Engine's thread

    def __init__(self, spec: EngineSpec, max_queue: int = 64):
        context = multiprocessing.get_context("spawn")  # CUDA and Metal do not survive a fork
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=run, args=(theirs, spec), name="mlxllama-engine")
        self.process.start()
        theirs.close()
        try:
            message = self.conn.recv()
        except EOFError:
            self.process.join()
            raise MlxLlamaError(f"the engine's process ended while loading {spec.path}"
                                f" (exit code {self.process.exitcode})") from None
        except BaseException:  # Ctrl-C while the model loads
            self.process.terminate()
            raise
        if message[0] == "failed":
            self.process.join()
            raise MlxLlamaError(message[1])
        _, self.budget, self.context = message
        self.max_queue = max_queue
        self.on_lost: Callable[[str], None] = lambda message: None
        self.tickets: dict[int, Ticket] = {}
        self.asked: dict[int, concurrent.futures.Future] = {}
        self.keys = itertools.count()
        self.running = 0  # requests in the batch, as of the engine's last message
        self.stopping = False
        self.sending = threading.Lock()
        self.reader = threading.Thread(target=self._read, name="mlxllama-engine-reader", daemon=True)
        self.reader.start()
        # A server's process that leaves without stop() (an error before it serves) would otherwise
        # wait at exit for the engine's, which waits on the pipe: multiprocessing joins its children
        # after the handlers registered later than its own, such as this one.
        atexit.register(self.stop)

    @property
    def waiting_count(self) -> int:
        return max(len(self.tickets) - self.running, 0)

    def submit(self, ticket: Ticket) -> Ticket:
        self.budget.check(ticket.request)
        if self.waiting_count >= self.max_queue:
            raise Overloaded(f"{self.max_queue} requests are already waiting")
        key = next(self.keys)
        self.tickets[key] = ticket

        def cancel() -> None:
            if key in self.tickets:  # else done already: the engine has let it go
                self._send(("cancel", key))

        ticket.on_cancel = cancel
        self._send(("submit", key, ticket.request))
        return ticket

    async def health(self) -> dict:
        nonce, answer = next(self.keys), concurrent.futures.Future()
        self.asked[nonce] = answer
        self._send(("health", nonce))
        return await asyncio.wait_for(asyncio.wrap_future(answer), HEALTH_TIMEOUT_S)

    def stop(self) -> None:
        """Stop the engine (its requests fail with "the server is stopping") and its process."""
        if self.stopping:
            return
        self.stopping = True
        try:
            self._send(("stop",))
        except OSError:
            pass  # gone already
        self.reader.join(timeout=30)
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()

    def _send(self, message: tuple) -> None:
        with self.sending:
            self.conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "events":
                _, self.running, events = message
                for key, kind, value in events:
                    self._deliver(key, kind, value)
            else:  # ("health", nonce, report)
                self.asked.pop(message[1]).set_result(message[2])
        self.process.join(timeout=30)
        lost = EngineLost(f"the engine's process ended (exit code {self.process.exitcode})")
        for key in list(self.tickets):
            self._deliver(key, "error", lost)
        for answer in self.asked.values():
            answer.set_exception(lost)
        if not self.stopping:
            self.on_lost(str(lost))

    def _deliver(self, key: int, kind: str, value) -> None:
        ticket = self.tickets.get(key) if kind == "text" else self.tickets.pop(key, None)
        if ticket is None:
            return
        with contextlib.suppress(RuntimeError):  # its event loop closed already: the server is stopping
            if kind == "text":
                ticket.on_text(value)
            elif kind == "done":
                ticket.on_done(value)
            else:
                ticket.on_error(value)


class Outbox:
    """The engine process's side of the pipe: a turn's events, sent together when the engine has
    handed them all on (Engine's handed_on), and answers to the server's questions."""

    def __init__(self, conn):
        self.conn = conn
        self.events: list[tuple[int, str, object]] = []
        self.sending = threading.Lock()
        self.engine: Engine | None = None

    def add(self, key: int, kind: str, value) -> None:
        if kind == "error":
            value = sendable(value)
        with self.sending:
            self.events.append((key, kind, value))

    def send_events(self) -> None:
        with self.sending:
            events, self.events = self.events, []
        if events:
            self.send(("events", self.engine.running if self.engine else 0, events))

    def send(self, message: tuple) -> None:
        with self.sending:
            try:
                self.conn.send(message)
            except OSError:
                pass  # the server's process is gone: the main loop sees the pipe's end and stops


def sendable(error: BaseException) -> BaseException:
    """The exception itself where it crosses a pipe intact, else a RuntimeError of its type and text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure to pickle means the stand-in
        return RuntimeError(f"{type(error).__name__}: {error}")


def run(conn, spec: EngineSpec) -> None:
    """The engine's process: load, warm up, say so, then serve the pipe until told to stop or until
    the server's process is gone (the pipe's end)."""
    # Ctrl-C in a terminal, `timeout`, or a service manager's stop reach the whole process group (or
    # cgroup): the server's process decides, stops this one through the pipe, and says why.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    outbox = Outbox(conn)
    try:
        engine, draft_model = start_engine(spec, outbox)
    except MlxLlamaError as e:
        conn.send(("failed", str(e)))
        return
    except Exception as e:  # noqa: BLE001 - said in one line by the server's process
        conn.send(("failed", f"the engine's process failed to start: {type(e).__name__}: {e}"))
        return
    outbox.engine = engine
    conn.send(("ready", engine.budget, engine.context))
    tickets: dict[int, Ticket] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        kind = message[0]
        if kind == "submit":
            _, key, request = message
            tickets[key] = ticket = engine_ticket(key, with_draft_model(request, draft_model), outbox, tickets)
            try:
                engine.submit(ticket)
            except Exception as e:  # noqa: BLE001 - the server's side checked the budget; reported, not fatal
                tickets.pop(key, None)
                outbox.add(key, "error", e)
                outbox.send_events()
        elif kind == "cancel":
            if (ticket := tickets.get(message[1])) is not None:
                ticket.cancel()
        elif kind == "health":
            outbox.send(("health", message[1], engine.report()))
        else:  # "stop"
            break
    engine.stop()
    conn.close()
    # As serve's process: leave without the interpreter's teardown, in which MLX aborts when it
    # frees arrays that the engine's thread made.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start_engine(spec: EngineSpec, outbox: Outbox):
    """The model (and draft model) loaded as the spec says, and an Engine over them whose events go to the outbox."""
    from ..runtime import load
    from ..speculative import Drafting

    runtime = load(spec.path, dtype=spec.dtype, dequantize=spec.dequantize, context_length=spec.context_length,
                   kv_quantization=spec.kv_quantization)
    draft_model = None
    if spec.draft_path:
        draft = load(spec.draft_path, dtype=spec.dtype, dequantize=spec.dequantize, context_length=spec.context_length)
        draft_model = Drafting.with_model(draft, runtime.tokenizer, spec.draft_tokens).model
    engine = Engine(runtime, max_queue=sys.maxsize, handed_on=outbox.send_events, **spec.engine)
    return engine, draft_model


def engine_ticket(key: int, request: Request, outbox: Outbox, tickets: dict[int, Ticket]) -> Ticket:
    def done(kind: str):
        def on(value) -> None:
            tickets.pop(key, None)
            outbox.add(key, kind, value)
        return on

    return Ticket(request, lambda value: outbox.add(key, "text", value), done("done"), done("error"))


def with_draft_model(request: Request, draft_model) -> Request:
    """The request with ENGINE_DRAFT_MODEL in its drafting made this process's draft model."""
    drafting = request.drafting
    if drafting is None or drafting.model != ENGINE_DRAFT_MODEL:
        return request
    return replace(request, drafting=replace(drafting, model=draft_model))
