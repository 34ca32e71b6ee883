"""The processes of one run under `mlx.launch`, and what they exchange besides a model's activations.

MLX's own distributed layer (`mx.distributed`: ring, JACCL, MPI, NCCL) and launcher start the
processes and connect them; this module only says who this process is and moves small things
between them. Rank 0 reads the input, samples and writes: what it read reaches the others through
`share`, and, for a model split over the ranks, every sampled token through `follow_rank0`, so all
ranks feed their parts of the model the same ids even when sampling is unseeded. Outside
`mlx.launch` there is one rank and every function here is the identity.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Any

import mlx.core as mx

from .errors import MlxLlamaError


@dataclass(frozen=True)
class World:
    group: Any  # mx.distributed.Group
    rank: int
    size: int

    @property
    def is_root(self) -> bool:
        return self.rank == 0


@cache
def world() -> World:
    """This process's place among the launched ones (rank 0 of 1 when not launched)."""
    if not mx.distributed.is_available():
        return World(None, 0, 1)
    group = mx.distributed.init()
    return World(group, group.rank(), group.size())


def launched() -> bool:
    return world().size > 1


def share(value: Any) -> Any:
    """Rank 0's `value` (anything JSON can hold) on every rank; the others' argument is ignored."""
    w = world()
    if w.size == 1:
        return value
    data = json.dumps(value).encode() if w.is_root else b""
    length = mx.distributed.all_sum(mx.array([len(data)], dtype=mx.int32), group=w.group).item()
    if length == 0:
        return value
    raw = mx.array(list(data), dtype=mx.int32) if w.is_root else mx.zeros((length,), dtype=mx.int32)
    received = mx.distributed.all_sum(raw, group=w.group)
    return json.loads(bytes(received.astype(mx.uint8).tolist()).decode())


def gather(value: Any) -> list[Any]:
    """Every rank's `value` (anything JSON can hold), in rank order, on every rank."""
    w = world()
    if w.size == 1:
        return [value]
    data = json.dumps(value).encode()
    lengths = mx.distributed.all_gather(mx.array([len(data)], dtype=mx.int32), group=w.group).tolist()
    padded = mx.zeros((max(lengths),), dtype=mx.int32)
    if data:
        padded[: len(data)] = mx.array(list(data), dtype=mx.int32)
    rows = mx.distributed.all_gather(padded[None], group=w.group).astype(mx.uint8).tolist()
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(rows, lengths)]


def follow_rank0(token: mx.array, group) -> mx.array:
    """Rank 0's sampled token(s) on every rank of `group` (a split model's), lazily: an all-sum to
    which the others add zeros. The others' zeros are computed from their own token, so that their
    sum runs where rank 0's does, after the forward pass: collectives must meet in one order."""
    mine = token if group.rank() == 0 else token * 0
    return mx.distributed.all_sum(mine, group=group)


def barrier() -> None:
    """Wait until every rank is here (a finished rank otherwise exits while another still reads from it)."""
    w = world()
    if w.size > 1:
        mx.eval(mx.distributed.all_sum(mx.array([0], dtype=mx.int32), group=w.group))


def lost_peer(error: RuntimeError) -> MlxLlamaError | None:
    """The one-line error for a collective that failed because another rank went away, else None."""
    text = str(error)
    if not launched() or not any(sign in text for sign in ("peer", "[ring]", "[jaccl]", "[mpi]", "[nccl]", "NCCL")):
        return None
    return MlxLlamaError(f"rank {world().rank}: another rank of this mlx.launch run stopped"
                         f" ({text.splitlines()[0].strip()}); ending this one too")
