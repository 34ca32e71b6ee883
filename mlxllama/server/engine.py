"""The server's generation engine: one thread that runs every request through one BatchDecoder.

Requests join the running batch at the next step (continuous batching) and leave it when done or
when their client goes away. The thread hands each request's text to its caller as it becomes
final, through a callback that the caller makes safe for its own thread (app.py posts to the event
loop).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..batching import BatchDecoder, Request, Row
from ..generate import PREFILL_CHUNK


@dataclass
class Ticket:
    """One request in the engine: `on_text((piece, logprobs))` as text becomes final (with the
    log-probabilities of the tokens since, when asked for), then `on_done(row)` or
    `on_error(exception)`, all called from the engine's thread."""

    request: Request
    on_text: Callable[[tuple[str, list]], None]
    on_done: Callable[[Row], None]
    on_error: Callable[[BaseException], None]
    cancelled: bool = False
    row: Row | None = field(default=None, repr=False)

    def cancel(self) -> None:
        """The caller went away: the row leaves the batch at the next step."""
        self.cancelled = True


class Engine:
    def __init__(self, runtime, max_batch: int = 16, prefill_chunk: int = PREFILL_CHUNK):
        self.decoder = BatchDecoder(runtime.model, runtime.tokenizer, max_batch, prefill_chunk)
        self.inbox: queue.Queue[Ticket | None] = queue.Queue()
        self.tickets: list[Ticket] = []
        self.thread = threading.Thread(target=self._run, name="mlxllama-engine", daemon=True)
        self.thread.start()

    @property
    def running(self) -> int:
        """Requests in the batch now."""
        return len(self.tickets)

    def submit(self, ticket: Ticket) -> Ticket:
        self.inbox.put(ticket)
        return ticket

    def stop(self) -> None:
        self.inbox.put(None)
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            if not self._admit():
                return
            self._drop_cancelled()
            try:
                # One chunk of a joining prompt, then one step of the running rows: a newcomer's
                # prefill holds the running streams up by one chunk at most.
                joined = self.decoder.prefill_chunk() if self.decoder.joining else None
                finished = ([joined] if joined else []) + self.decoder.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
                for ticket in self.tickets:
                    ticket.on_error(e)
                self.decoder.drop([t.row for t in self.tickets])
                self.tickets = []
                continue
            for ticket in self.tickets:
                self._hand_on(ticket)
            for ticket in [t for t in self.tickets if t.row in finished]:
                self._finish(ticket)

    def _admit(self) -> bool:
        """Take waiting requests while there is room, waiting for one when nothing runs; False to stop."""
        while self.decoder.room:
            try:
                ticket = self.inbox.get(block=not self.tickets)
            except queue.Empty:
                return True
            if ticket is None:
                return False
            if ticket.cancelled:
                continue
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
        ticket.row.result()  # closes the text: what was held back for stop strings is final now
        self._hand_on(ticket)
        ticket.on_done(ticket.row)

    @staticmethod
    def _hand_on(ticket: Ticket) -> None:
        text, logprobs = ticket.row.take_text(), ticket.row.take_logprobs()
        if text or logprobs:
            ticket.on_text((text, logprobs))

    def _drop_cancelled(self) -> None:
        gone = [t for t in self.tickets if t.cancelled]
        if gone:
            self.decoder.drop([t.row for t in gone])
            self.tickets = [t for t in self.tickets if not t.cancelled]
