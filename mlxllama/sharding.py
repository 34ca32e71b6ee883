"""Which part of a model each rank of an `mlx.launch` run holds: tensor-parallel pieces or pipeline stages.

Tensor parallel (Megatron's split): Q/K/V and gate/up are split by output, whole heads and equal
shares of the FFN width to each rank; the attention output and the down projection by input, so
each rank's partial sums meet in one all-reduce after each (models.transformer.Block). A mixture's
experts are split the same way, every expert's width across the ranks. Embedding, norms, router
and head are replicated. Each rank reads only its pieces from the file (tensors.cut).

Pipeline: contiguous ranges of layers, one a rank, for links too slow for an all-reduce a layer
and for models whose heads do not divide among the ranks; picked with --pipeline, and on its own
when tensor parallelism cannot split the model (`Shard.reason` says why).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import MlxLlamaError
from .models import ModelConfig
from .quants import AFFINE_GROUP_SIZE
from .tensors import Piece


@dataclass(frozen=True)
class Shard:
    """What one rank holds. `layers` are the blocks it runs (all of them in tensor mode)."""

    mode: str  # "tensor" or "pipeline"
    rank: int
    size: int
    layers: range
    group: Any = None  # the mx.distributed group the all-reduces and hand-overs use
    reason: str = ""  # why a pipeline was chosen when tensor parallelism was not asked against
    # How a pipeline stage passes its output on: "send" to the next stage, or "sum", an all-sum of
    # every rank (MLX 0.32 has no send or receive on CUDA, where NCCL runs its collectives).
    hand_over: str = "send"

    @property
    def first(self) -> bool:
        return self.layers.start == 0

    def holds(self, name: str) -> bool:
        """Whether this rank loads the file's tensor `name`."""
        return not name.startswith("blk.") or int(name.split(".")[1]) in self.layers

    def block_config(self, config: ModelConfig) -> ModelConfig:
        """The config a block of this rank is built with: its share of the heads and FFN width."""
        if self.mode != "tensor":
            return config
        n = self.size
        return dataclasses.replace(config, n_heads=config.n_heads // n, n_kv_heads=config.n_kv_heads // n,
                                   ffn_size=config.ffn_size // n, expert_ffn_size=config.expert_ffn_size // n)

    def piece(self, name: str, config: ModelConfig) -> Piece | None:
        """The part of tensor `name` this rank holds (None: all of it)."""
        if self.mode != "tensor" or not name.startswith("blk."):
            return None
        kind = name.split(".")[2]
        heads, kv_heads, head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
        q, kv = self._share(q_dim), self._share(kv_dim)
        ffn, experts = self._share(config.ffn_size), self._share(config.expert_ffn_size)
        shifted = lambda part, by: (part[0] + by, part[1] + by)  # noqa: E731
        rows = {"attn_q": (q,), "attn_k": (kv,), "attn_v": (kv,),
                "attn_qkv": (q, shifted(kv, q_dim), shifted(kv, q_dim + kv_dim)),
                "ffn_gate": (ffn,), "ffn_gate_exps": (experts,), "ffn_up_exps": (experts,),
                # A file's fused gate/up (Phi-3) holds gate's rows, then up's.
                "ffn_up": (ffn, shifted(ffn, config.ffn_size)) if config.fused_gate_up else (ffn,)}
        columns = {"attn_output": q, "ffn_down": ffn, "ffn_down_exps": experts}
        if kind in rows:
            return Piece(rows=rows[kind])
        if kind in columns and name.endswith(".weight"):
            return Piece(columns=columns[kind])
        return None

    def _share(self, width: int) -> tuple[int, int]:
        part = width // self.size
        return self.rank * part, (self.rank + 1) * part


def plan_shard(config: ModelConfig, rank: int, size: int, group=None, pipeline: bool = False,
               native: bool = True, hand_over: str = "send") -> Shard:
    """The part of the model `rank` of `size` holds: tensor parallel unless `pipeline` is asked
    for or the model does not split so (then a pipeline, its reason kept in the Shard, its stages
    handing over by `hand_over`)."""
    if size < 1 or not 0 <= rank < size:
        raise MlxLlamaError(f"rank {rank} of {size} ranks")
    reason = "" if pipeline else tensor_split_problem(config, size, native)
    if not pipeline and not reason:
        return Shard("tensor", rank, size, range(config.n_layers), group)
    if config.n_layers < size:
        raise MlxLlamaError(f"a pipeline of {size} ranks needs at least as many layers; the model has {config.n_layers}")
    base, extra = divmod(config.n_layers, size)
    start = rank * base + min(rank, extra)
    return Shard("pipeline", rank, size, range(start, start + base + (rank < extra)), group, reason, hand_over)


def tensor_split_problem(config: ModelConfig, size: int, native: bool) -> str:
    """Why the model's layers cannot be split by tensor among `size` ranks ("" if they can)."""
    # In native mode the pieces split by input are cut along whole groups of MLX's affine format.
    unit = AFFINE_GROUP_SIZE if native else 1
    checks = [("attention heads", config.n_heads, 1), ("KV heads", config.n_kv_heads, 1),
              ("FFN width", config.ffn_size, unit), ("expert FFN width", config.expert_ffn_size, unit)]
    for what, count, multiple in checks:
        if count and count % (size * multiple):
            per = f" in groups of {multiple}" if multiple > 1 else ""
            return f"its {count} {what} do not divide among {size} ranks{per}"
    if config.n_heads * config.head_dim // size % unit:
        return f"a rank's share of the attention output ({config.n_heads * config.head_dim // size}) is not whole groups of {unit}"
    return ""
