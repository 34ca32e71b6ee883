"""Seeing inside a forward pass: per-layer statistics, the top tokens at each step, and hidden-state dumps.

`trace` feeds a prompt through the model with the real KV cache, then generates greedily, one
token per step, recording what each layer produced. Two dumps (ours, or another implementation's
written in the same format) are compared by `compare_dumps`, which names the first layer and
position that diverge, so a wrong runtime can be bisected to one layer instead of guessed at.

Dump format (a directory, version 1)
------------------------------------
`meta.json`, an object; only "token_ids" is required, the rest is informative:
    "format": "mlxllama-trace", "version": 1,
    "token_ids": the id fed at each position, in order (the prompt, then the generated tokens fed back),
    "prompt_length", "model", "n_layers", "hidden_size", "dtype": "float32".
One `.npy` file per recorded tensor, each float32 of shape [positions, hidden], row p holding
the value for the token at position p:
    `embd.npy`                 token embeddings, the input of layer 0 (llama.cpp's `embd` or `inp_embd`)
    `layer_{i:03d}_attn.npy`   layer i's attention output after its output projection, before it is
                               added to the residual stream (llama.cpp's `attn_out-{i}`)
    `layer_{i:03d}_mlp.npy`    layer i's MLP output, before it is added (llama.cpp's first `ffn_out-{i}`)
    `layer_{i:03d}_resid.npy`  the residual stream after layer i (llama.cpp's `l_out-{i}`)
Layers count from 0. A dump may hold any subset of these files; compare uses those in both.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np

from .cache import KVCache
from .errors import MlxLlamaError, count
from .files import WriteError, write_text_atomic
from .generate import check_fits
from .models import Transformer
from .models.transformer import residual_add
from .tokenizer import Tokenizer

DUMP_FORMAT = "mlxllama-trace"
DUMP_VERSION = 1
KINDS = ("attn", "mlp", "resid")
# Per position, the largest ||a - b|| / ||b|| that still counts as the same. Two correct
# implementations with the same F16 weights agree to about 1e-3; llama.cpp's CPU backend rounds
# activations to 8 bits before quantized matrix products, which alone makes 1-6% on chat-tiny
# Q4_K_M; a real bug (wrong RoPE, a misread block) makes tens of percent.
DEFAULT_TOLERANCE = 0.1
_LAYER_FILE = re.compile(r"layer_(\d{3})_(attn|mlp|resid)\.npy")


@dataclass
class Stats:
    rms: float
    min: float
    max: float
    mean: float


@dataclass
class Candidate:
    token_id: int
    logit: float
    text: str


@dataclass
class HeadStats:
    """One head's softmax for one query position."""

    entropy: float  # in nats: 0 when all weight is on one key, ln(keys) when spread evenly
    max_weight: float
    max_position: int  # the position of the key that weight falls on
    bos: float | None  # the weight on position 0; None once the cache no longer holds it
    recent: float  # the weight on the last RECENT positions up to the query


@dataclass
class Attention:
    """A pass's attention (trace --attention): each layer's heads at the pass's last query
    position, the heads that collapsed, and the layers whose last query cannot see every earlier
    position (its window, or positions its cache no longer holds)."""

    heads: list[list[HeadStats]]  # [layer][head]
    collapsed: list[tuple[int, int]]  # (layer, head): one weight over COLLAPSED for every query of a pass of several
    unseen: list[tuple[int, int, int, int]]  # (layer, first position seen, last position, window or 0)


@dataclass
class Pass:
    """One forward call: the prompt (prefill) or one generated token fed back."""

    token_ids: list[int]
    first_position: int
    cache_length: int  # positions in the cache after this pass
    stats: dict[str, Stats]  # by dump name ("embd", "layer_000_attn", ...), in computation order
    top: list[Candidate]  # the likeliest next tokens after this pass, best first
    attention: Attention | None = None


@dataclass
class Trace:
    passes: list[Pass]
    # Per dump name ("embd", "layer_000_attn", ...), float32 [positions, hidden]; kept only when dumping.
    hidden: dict[str, np.ndarray] = field(default_factory=dict)
    # With attention and dumping: every query position's head stats, [position][layer][head].
    attention: list[list[list[HeadStats]]] = field(default_factory=list)
    # With attention: the prompt pass's weights, a float32 [heads, queries, keys] a layer (for --plot).
    prompt_weights: list[np.ndarray] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for p in self.passes for t in p.token_ids]


# Weight on the last this-many positions is reported as "recent"; a softmax whose largest weight
# is over COLLAPSED for every query (with at least two keys to choose from) has collapsed.
RECENT = 16
COLLAPSED = 0.99


def head_stats(weights: np.ndarray, key_positions: np.ndarray, query_position: int) -> list[HeadStats]:
    """weights [heads, keys] (a query's softmax over the keys at `key_positions`) -> each head's stats."""
    w = weights.astype(np.float64)
    entropy = -(w * np.log(np.where(w > 0, w, 1))).sum(axis=-1)
    best = w.argmax(axis=-1)
    holds_bos = bool(len(key_positions)) and key_positions.min() == 0
    recent = w[:, key_positions > query_position - RECENT].sum(axis=-1)
    return [HeadStats(float(entropy[h]), float(w[h, best[h]]), int(key_positions[best[h]]),
                      float(w[h, key_positions == 0].sum()) if holds_bos else None, float(recent[h]))
            for h in range(w.shape[0])]


def attention_of(probes: list[list[mx.array]], cache: list[KVCache], windows: list[int],
                 first_position: int) -> tuple[Attention, list]:
    """A pass's Attention from each layer's weights [1, heads, length, keys], and every query
    position's head stats (for dumps): [position][layer][head]."""
    heads, collapsed, unseen, per_position = [], [], [], []
    for layer, (weights, layer_cache, window) in enumerate(zip((p[0] for p in probes), cache, windows)):
        w = np.array(weights[0].astype(mx.float32))  # [heads, length, keys]
        positions, slots = layer_cache.held()
        key_positions = np.empty(w.shape[-1], dtype=np.int64)
        key_positions[slots] = positions
        length = w.shape[1]
        rows = [head_stats(w[:, q], key_positions, first_position + q) for q in range(length)]
        per_position.append(rows)
        heads.append(rows[-1])
        # A query that sees a single key (the first position) has no choice to make: it is left
        # out, and a pass with fewer than two queries that choose (a decoding step) is no evidence.
        choosing = first_position + np.arange(length) > key_positions.min()
        if choosing.sum() > 1:
            largest = w[:, choosing].max(axis=-1)  # [heads, queries that choose]
            collapsed += [(layer, h) for h in range(w.shape[0]) if (largest[h] > COLLAPSED).all()]
        last = first_position + length - 1
        seen = max(int(positions[0]), last - window + 1 if window else 0)
        if seen > 0:
            unseen.append((layer, seen, last, window))
    per_position = [[per_position[layer][q] for layer in range(len(per_position))] for q in range(len(per_position[0]))]
    return Attention(heads, collapsed, unseen), per_position


def stats_of(x: mx.array) -> Stats:
    x = x.astype(mx.float32)
    values = mx.stack([mx.sqrt(mx.mean(x * x)), mx.min(x), mx.max(x), mx.mean(x)]).tolist()
    return Stats(*values)


def _traced_forward(model: Transformer, ids: Sequence[int], cache: list[KVCache]) -> tuple[mx.array, dict]:
    """Transformer.__call__ for one sequence, keeping each layer's pieces; -> (logits [length, vocab], pieces).

    It repeats Block.__call__'s two residual additions to see what each adds; the tests check
    that its logits are the model's.
    """
    h, h_compute = model.embed(mx.array([list(ids)])), None
    masks = model.masks(len(ids), cache)
    pieces = {"embd": h[0]}
    for i, block in enumerate(model.blk):
        attn = block.attention_residual(h if h_compute is None else h_compute, masks[block.window], cache[i])
        h, h_compute = residual_add(h, attn)
        mlp = block.mlp_residual(h_compute)
        h, h_compute = residual_add(h, mlp)
        pieces.update({f"layer_{i:03d}_attn": attn[0], f"layer_{i:03d}_mlp": mlp[0], f"layer_{i:03d}_resid": h[0]})
    return model.head(h)[0], pieces


def stats_label(name: str) -> str:
    """'layer_003_mlp' -> '3.mlp'; 'embd' stays."""
    match = re.fullmatch(r"layer_(\d{3})_(\w+)", name)
    return f"{int(match.group(1))}.{match.group(2)}" if match else name


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    # Control tokens decode to nothing; their vocabulary text ("</s>") says which one it is.
    return tokenizer.id_to_piece(token_id) if tokenizer.is_control(token_id) else tokenizer.decode([token_id])


def top_candidates(logits: mx.array, tokenizer: Tokenizer, k: int) -> list[Candidate]:
    order = mx.argsort(-logits)[:k].tolist()
    values = logits[mx.array(order)].tolist()
    return [Candidate(t, v, token_text(tokenizer, t)) for t, v in zip(order, values)]


def trace(model: Transformer, tokenizer: Tokenizer, prompt_ids: Sequence[int], cache: list[KVCache],
          steps: int = 1, top_k: int = 5, keep_hidden: bool = False, attention: bool = False) -> Trace:
    """Prefill prompt_ids, then feed back `steps - 1` greedy tokens, recording every pass.

    Each pass predicts one token, so `steps` passes give `steps` predictions; generation stops
    early at a stop token or at the end of the context. With `attention`, every layer attends
    through an explicit softmax whose weights each pass reports (Pass.attention; with
    keep_hidden, every position's, as Trace.attention).
    """
    context = model.config.context_length
    check_fits(len(prompt_ids), context)
    passes, hidden, per_position, prompt_weights = [], {}, [], []
    ids = list(prompt_ids)
    try:
        while True:
            first_position = cache[0].offset
            for block in model.blk:
                block._attention_probe = [] if attention else None
            logits, pieces = _traced_forward(model, ids, cache)
            mx.eval(logits, pieces)
            passes.append(Pass(ids, first_position, cache[0].offset, {n: stats_of(x) for n, x in pieces.items()},
                               top_candidates(logits[-1], tokenizer, top_k)))
            if attention:
                probes, windows = [b._attention_probe for b in model.blk], [b.window for b in model.blk]
                if len(passes) == 1:
                    prompt_weights = [np.array(p[0][0].astype(mx.float32)) for p in probes]
                passes[-1].attention, rows = attention_of(probes, cache, windows, first_position)
                per_position += rows
            if keep_hidden:
                for name, x in pieces.items():
                    hidden.setdefault(name, []).append(np.array(x.astype(mx.float32)))
            token = passes[-1].top[0].token_id
            if len(passes) >= steps or token in tokenizer.stop_ids or cache[0].offset >= context:
                break
            ids = [token]
    finally:
        for block in model.blk:
            block._attention_probe = None
    return Trace(passes, {name: np.concatenate(rows) for name, rows in hidden.items()},
                 per_position if keep_hidden else [], prompt_weights)


def write_dump(directory: str | os.PathLike, result: Trace, prompt_length: int, model_path: str,
               model: Transformer) -> None:
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
        # meta.json goes first and comes back last: a dump cut short has none, and compare refuses it.
        (out / "meta.json").unlink(missing_ok=True)
        for name, rows in result.hidden.items():
            np.save(out / f"{name}.npy", rows.astype(np.float32))
        for layer, weights in enumerate(result.prompt_weights):  # [heads, prompt queries, keys], for --plot
            np.save(out / f"layer_{layer:03d}_weights.npy", weights.astype(np.float32))
        if result.attention:
            # [positions, heads, 5]: entropy, max weight, its position, weight on BOS (NaN once
            # dropped), weight on the last RECENT positions
            for layer in range(len(result.attention[0])):
                rows = [[(h.entropy, h.max_weight, h.max_position, np.nan if h.bos is None else h.bos, h.recent)
                         for h in position[layer]] for position in result.attention]
                np.save(out / f"layer_{layer:03d}_attention.npy", np.array(rows, dtype=np.float32))
        meta = {
            "format": DUMP_FORMAT, "version": DUMP_VERSION, "model": model_path, "token_ids": result.token_ids,
            "prompt_length": prompt_length, "context_length": model.config.context_length,
            "n_layers": model.config.n_layers,
            "hidden_size": model.config.hidden_size, "dtype": "float32",
        }
        write_text_atomic(out / "meta.json", json.dumps(meta, indent=1) + "\n")
    except OSError as e:
        raise WriteError(getattr(e, "filename", None) or directory, e) from None


# ---- comparing dumps -----------------------------------------------------------------------


@dataclass
class LayerDiff:
    name: str  # dump name, e.g. "layer_002_mlp"
    max_error: float  # the largest relative error of a row (position)
    position: int  # where it is largest
    first_diverging: int | None  # the first position whose error exceeds the tolerance
    first_error: float | None  # the error there


@dataclass
class Comparison:
    tolerance: float
    positions: int  # positions compared: the common prefix of both dumps' token ids
    layers: list[LayerDiff]  # in computation order
    notes: list[str]
    # The prompt's length (the reference's meta): position p >= it was fed by decoding step
    # p - prompt_length + 2, the prompt being step 1.
    prompt_length: int | None = None
    # Where the token ids part, when both dumps go on past it: (position, id in A, id in B).
    token_divergence: tuple[int, int, int] | None = None

    @property
    def first_divergence(self) -> LayerDiff | None:
        return next((d for d in self.layers if d.first_diverging is not None), None)

    @property
    def diverged(self) -> bool:
        """A layer over the tolerance, or, with every layer within it, different tokens fed."""
        return self.first_divergence is not None or self.token_divergence is not None

    def step(self, position: int) -> int:
        """The pass of `trace --steps` that fed `position`: 1 for the prompt, then one a token."""
        if self.prompt_length is None or position < self.prompt_length:
            return 1
        return position - self.prompt_length + 2


def read_meta(directory: str | os.PathLike) -> dict:
    path = Path(directory) / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise MlxLlamaError(f"{path}: cannot read the dump's meta.json ({e.strerror})")
    except ValueError as e:
        raise MlxLlamaError(f"{path}: not valid JSON ({e})")
    if not isinstance(meta, dict) or not isinstance(meta.get("token_ids"), list):
        raise MlxLlamaError(f"{path}: expected a JSON object with a 'token_ids' list")
    return meta


def dump_names(directory: str | os.PathLike) -> list[str]:
    """The dump's tensor names in computation order: embd, then each layer's attn, mlp, resid."""
    names = [p.name for p in Path(directory).iterdir()]
    layers = sorted((int(m.group(1)), KINDS.index(m.group(2))) for m in map(_LAYER_FILE.fullmatch, names) if m)
    return (["embd"] if "embd.npy" in names else []) + [f"layer_{i:03d}_{KINDS[k]}" for i, k in layers]


def _load_rows(directory: str | os.PathLike, name: str, positions: int) -> np.ndarray:
    path = Path(directory) / f"{name}.npy"
    try:
        rows = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise MlxLlamaError(f"{path}: cannot read ({e})")
    if rows.ndim != 2 or rows.shape[0] < positions:
        raise MlxLlamaError(f"{path}: expected [positions >= {positions}, hidden], found shape {list(rows.shape)}")
    return rows[:positions].astype(np.float64)


def row_errors(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per position, ||a - b|| / ||b||: scale-free, so one tolerance serves every layer."""
    scale = np.maximum(np.linalg.norm(b, axis=1), 1e-30)
    return np.linalg.norm(a - b, axis=1) / scale


def layer_errors(dir_a: str | os.PathLike, dir_b: str | os.PathLike, name: str, positions: int) -> np.ndarray:
    """Tensor `name`'s relative error at each of the first `positions` positions; a NaN or an
    infinity on either side counts as the largest possible error."""
    if not positions:
        return np.zeros(0)
    a, b = _load_rows(dir_a, name, positions), _load_rows(dir_b, name, positions)
    if a.shape != b.shape:
        raise MlxLlamaError(f"{name}: shapes differ ({list(a.shape)} vs {list(b.shape)})")
    return np.nan_to_num(row_errors(a, b), nan=np.inf, posinf=np.inf)


def compare_dumps(dir_a: str | os.PathLike, dir_b: str | os.PathLike,
                  tolerance: float = DEFAULT_TOLERANCE) -> Comparison:
    """Compare dump A against reference dump B, position by position, in computation order."""
    meta_a, meta_b = read_meta(dir_a), read_meta(dir_b)
    ids_a, ids_b = meta_a["token_ids"], meta_b["token_ids"]
    positions = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
    notes, token_divergence = [], None
    if positions < min(len(ids_a), len(ids_b)):
        token_divergence = (positions, ids_a[positions], ids_b[positions])
        notes.append(f"the token ids differ from position {positions} on; only the positions before it are compared")
    elif positions < max(len(ids_a), len(ids_b)):
        notes.append(f"the dumps have {len(ids_a)} and {len(ids_b)} positions; the first {positions} are compared")
    contexts = meta_a.get("context_length"), meta_b.get("context_length")
    if None not in contexts and contexts[0] != contexts[1]:
        notes.append(f"the dumps were made at contexts of {contexts[0]} and {contexts[1]} tokens: a model whose RoPE"
                     " depends on the context (Phi-3's LongRoPE) differs for that alone; trace with --ctx")
    names_a, names_b = dump_names(dir_a), dump_names(dir_b)
    only = sorted(set(names_a) ^ set(names_b))
    if only:
        notes.append(f"in one dump only, not compared: {', '.join(only)}")
    layers = []
    for name in (n for n in names_a if n in names_b):
        errors = layer_errors(dir_a, dir_b, name, positions)
        over = np.flatnonzero(errors > tolerance)
        worst = int(np.argmax(errors)) if positions else 0
        first = int(over[0]) if len(over) else None
        first_error = None if first is None else float(errors[first])
        layers.append(LayerDiff(name, float(errors[worst]) if positions else 0.0, worst, first, first_error))
    if not layers:
        raise MlxLlamaError(f"{dir_a} and {dir_b} have no tensor in common")
    prompt_length = meta_b.get("prompt_length", meta_a.get("prompt_length"))
    return Comparison(tolerance, positions, layers, notes, prompt_length, token_divergence)


# ---- text reports ----------------------------------------------------------------------------


def format_pass(number: int, result: Pass, tokenizer: Tokenizer) -> str:
    if number == 1:
        fed = f"prompt, positions {result.first_position}-{result.cache_length - 1} ({count(len(result.token_ids), 'token')})"
    else:
        token = result.token_ids[0]
        text = json.dumps(token_text(tokenizer, token), ensure_ascii=False)
        fed = f"token {token} {text} at position {result.first_position}"
    lines = [f"pass {number}: {fed}, cache length {result.cache_length}",
             f"  {'layer':<10} {'rms':>11} {'min':>11} {'max':>11} {'mean':>11}"]
    for name, s in result.stats.items():
        lines.append(f"  {stats_label(name):<10} {s.rms:11.5g} {s.min:11.5g} {s.max:11.5g} {s.mean:11.5g}")
    if result.attention is not None:
        lines += format_attention(result.attention, result.cache_length - 1)
    lines.append("  next: " + " | ".join(
        f"{c.token_id} {json.dumps(c.text, ensure_ascii=False)} {c.logit:.4f}" for c in result.top))
    return "\n".join(lines)


def format_attention(attention: Attention, query_position: int) -> list[str]:
    lines = [f"  attention of position {query_position}:",
             f"  {'head':<10} {'entropy':>8} {'max':>7} {'at':>6} {'BOS':>7} {f'last {RECENT}':>8}"]
    for layer, heads in enumerate(attention.heads):
        for h, s in enumerate(heads):
            bos = "-" if s.bos is None else f"{s.bos:.3f}"
            lines.append(f"  {f'{layer}.{h}':<10} {s.entropy:8.3f} {s.max_weight:7.3f} {s.max_position:>6} {bos:>7}"
                         f" {s.recent:8.3f}")
    if attention.collapsed:
        lines.append(f"  collapsed: {', '.join(f'{l}.{h}' for l, h in attention.collapsed)} (one weight over"
                     f" {COLLAPSED} for every query of the pass)")
    else:
        lines.append("  collapsed: none")
    for layer, first, last, window in attention.unseen:
        why = f"its window of {window}" if window and first == last - window + 1 else "its cache holds no earlier one"
        lines.append(f"  unseen: layer {layer} sees positions {first}-{last} only ({why})")
    return lines


def format_comparison(comparison: Comparison, dir_a: str, dir_b: str) -> str:
    lines = [f"comparing {dir_a} against {dir_b}: {comparison.positions} positions, tolerance "
             f"{comparison.tolerance:g} (per position: ||a - b|| / ||b||)"]
    lines += [f"note: {note}" for note in comparison.notes]
    lines.append(f"  {'layer':<10} {'max error':>11} {'at':>5}  first over")
    for d in comparison.layers:
        over = "-" if d.first_diverging is None else str(d.first_diverging)
        lines.append(f"  {stats_label(d.name):<10} {d.max_error:11.4g} {d.position:>5}  {over}")
    first, tokens = comparison.first_divergence, comparison.token_divergence
    if first is not None:
        position = first.first_diverging
        lines.append(f"first divergence: layer {stats_label(first.name)} ({first.name}.npy) at position "
                     f"{position} (step {comparison.step(position)}): error {first.first_error:.4g} > {comparison.tolerance:g}")
    elif tokens is not None:
        position, ours, theirs = tokens
        where = ("the prompt's tokens (the tokenizer or the template)" if comparison.step(position) == 1 else
                 "the token the step before chose (the head, its logits or the sampling)")
        lines.append(f"first divergence: the token ids at position {position} (step {comparison.step(position)}):"
                     f" {ours} in {dir_a}, {theirs} in {dir_b}, every layer within {comparison.tolerance:g} before it;"
                     f" look at {where}")
    else:
        lines.append(f"no divergence: every position of every layer is within {comparison.tolerance:g}")
    return "\n".join(lines)
