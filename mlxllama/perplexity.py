"""Perplexity of a model on a text, computed as llama.cpp's `llama-perplexity` computes it.

So that figures can be compared with llama.cpp's:
- the text is read as `-f` reads it (one trailing newline dropped) and tokenized whole, with BOS
  when the vocabulary adds one and without parsing control tokens;
- the tokens are cut into `n_ctx`-token chunks (a last partial chunk is dropped; at least two
  chunks are needed), each evaluated from an empty cache, with its first token replaced by BOS
  when the vocabulary adds one;
- in each chunk only the second half is scored: the logits at positions n_ctx/2 ... n_ctx-2
  predict the tokens after them, so every scored token has at least n_ctx/2 tokens of context;
- PPL = exp(mean negative log-likelihood) over all scored tokens, and its uncertainty is
  PPL x the standard error of that mean, as llama.cpp's "Final estimate: PPL = x +/- y".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from .errors import MlxLlamaError, count as count_of
from .generate import PREFILL_CHUNK
from .models import Transformer


@dataclass
class PerplexityResult:
    ppl: float
    uncertainty: float  # one standard error, in PPL units
    n_ctx: int
    n_tokens: int  # tokens in the whole text (with BOS)
    n_chunks: int
    n_scored: int
    running: list[float]  # the estimate after each chunk, as llama.cpp prints "[1]x,[2]y,..."

    def to_dict(self) -> dict:
        return {"ppl": self.ppl, "uncertainty": self.uncertainty, "n_ctx": self.n_ctx, "n_tokens": self.n_tokens,
                "n_chunks": self.n_chunks, "n_scored": self.n_scored, "running": self.running}


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise MlxLlamaError(f"{path}: cannot read text ({e.strerror if isinstance(e, OSError) else e})")
    # llama.cpp's -f drops one trailing newline; doing the same keeps the token count equal.
    return text[:-1] if text.endswith("\n") else text


def negative_log_likelihoods(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, as llama.cpp computes it: float32 exponentials, summed in double."""
    peak = logits.max(axis=1, keepdims=True)
    sum_exp = np.exp(logits - peak).sum(axis=1, dtype=np.float64)
    picked = np.take_along_axis(logits - peak, targets[:, None], axis=1)[:, 0]
    return np.log(sum_exp) - picked.astype(np.float64)


def chunk_nll(model: Transformer, chunk: Sequence[int], first: int) -> np.ndarray:
    """Negative log-likelihoods of chunk[first+1:] given what precedes each, from one fresh cache."""
    cache = model.make_cache()
    nll = []
    # Fed in pieces of PREFILL_CHUNK tokens, so that few rows of vocabulary-wide logits exist at a time.
    for start in range(0, len(chunk), PREFILL_CHUNK):
        piece = list(chunk[start : start + PREFILL_CHUNK])
        hidden = model.hidden_states(mx.array([piece]), cache)[0]
        # Row r predicts chunk[start + r + 1]; only positions first ... len(chunk) - 2 are scored,
        # so only their rows go through the output layer (most of the cost of a small model).
        lo, hi = max(first - start, 0), min(len(piece), len(chunk) - 1 - start)
        if lo < hi:
            logits = np.array(model.head(hidden[lo:hi]), dtype=np.float32)
            nll.append(negative_log_likelihoods(logits, np.array(chunk[start + lo + 1 : start + hi + 1])))
        mx.eval([c.state for c in cache])
    return np.concatenate(nll)


def perplexity(model: Transformer, tokens: Sequence[int], n_ctx: int, bos_id: int | None,
               on_chunk: Callable[[int, float], None] | None = None) -> PerplexityResult:
    """Perplexity over `tokens` (the whole text, tokenized); bos_id replaces each chunk's first token unless None.

    on_chunk(i, running estimate) is called after chunk i (from 1), to show progress.
    """
    if n_ctx < 4:
        raise MlxLlamaError(f"--ctx must be at least 4, not {n_ctx}")
    if n_ctx > model.config.context_length:
        raise MlxLlamaError(f"--ctx {n_ctx} is more than the model's context of {model.config.context_length}")
    if len(tokens) < 2 * n_ctx:
        raise MlxLlamaError(f"the text is {count_of(len(tokens), 'token')}; perplexity with --ctx {n_ctx} needs at least "
                            f"{2 * n_ctx} (two chunks)")
    n_chunks, first = len(tokens) // n_ctx, n_ctx // 2
    total = total_sq = 0.0
    count = 0
    running = []
    for i in range(n_chunks):
        chunk = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        nll = chunk_nll(model, chunk, first)
        total, total_sq, count = total + nll.sum(), total_sq + (nll * nll).sum(), count + len(nll)
        running.append(math.exp(total / count))
        if on_chunk:
            on_chunk(i + 1, running[-1])
    mean = total / count
    variance = total_sq / count - mean * mean
    ppl = math.exp(mean)
    uncertainty = math.sqrt(variance / (count - 1)) * ppl if variance > 0 else 0.0
    return PerplexityResult(ppl, uncertainty, n_ctx, len(tokens), n_chunks, count, running)
