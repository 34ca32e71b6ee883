"""`mlxllama serve` under mlx.launch with a split model: rank 0 serves HTTP, the others follow.

Every rank holds a part of the model, so every rank must make the same batch decoder calls, in the
same order: rank 0's engine decides them (which requests join, leave, prefill, step) and
LeadingDecoder sends each call to the other ranks before making it; `follow` makes the same calls
on their own decoder. Tokens need no sending: a split model's rows all take rank 0's samples
(sampling.make_sampler). Only the requests' contents travel, as JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses

from ..batching import BatchDecoder, Request, Row
from ..constraints import Constraint
from ..distributed import share
from ..sampling import SamplingParams


class LeadingDecoder:
    """Rank 0's BatchDecoder: each call that runs the model or changes the batch is first sent to
    the other ranks (follow); everything else is the decoder's own."""

    def __init__(self, decoder: BatchDecoder):
        self.decoder = decoder

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def admit(self, index: int, request: Request) -> Row:
        share(["admit", index, request_to_json(request)])
        return self.decoder.admit(index, request)

    def prefill_chunk(self) -> list[Row]:
        share(["prefill"])
        return self.decoder.prefill_chunk()

    def step(self) -> list[Row]:
        share(["step"])
        return self.decoder.step()

    def drop(self, rows) -> None:
        share(["drop", [row.index for row in rows]])
        self.decoder.drop(rows)

    def close(self) -> None:
        """The engine stopped: so do the followers."""
        share(["stop"])


def follow(decoder: BatchDecoder) -> None:
    """A rank other than 0: make rank 0's decoder calls on `decoder` until it stops. A call that
    fails there fails here too, and is dropped the same way (the engine's own drop follows)."""
    rows: dict[int, Row] = {}
    while True:
        call, *args = share(None)
        if call == "stop":
            return
        with contextlib.suppress(Exception):  # rank 0 reports it to the request's client
            if call == "admit":
                index, request = args
                rows[index] = decoder.admit(index, request_from_json(request))
            elif call == "prefill":
                decoder.prefill_chunk()
            elif call == "step":
                decoder.step()
            elif call == "drop":
                decoder.drop([rows.pop(index) for index in args[0] if index in rows])
        rows = {index: row for index, row in rows.items() if not row.finished}


def request_to_json(request: Request) -> dict:
    out = dataclasses.asdict(request)
    out["ids"], out["stop"] = list(request.ids), list(request.stop)
    return out


def request_from_json(data: dict) -> Request:
    params = data["params"]
    params["logit_bias"] = tuple(tuple(pair) for pair in params["logit_bias"])
    constraint = Constraint(**data["constraint"]) if data["constraint"] else None
    return Request(**{**data, "params": SamplingParams(**params), "constraint": constraint,
                      "stop": tuple(data["stop"])})
