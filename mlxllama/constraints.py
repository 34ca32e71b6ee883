"""Constrained decoding: a JSON Schema, a regex or a grammar decides which tokens may come next.

The constraint engine is llguidance (the one behind llama.cpp's structured output): it compiles the
constraint into a parser over bytes and, given our vocabulary as the bytes each token decodes to,
answers with the set of tokens that keep the output inside the language. The sampler sets every
other token's logit to -inf before temperature, top-k and top-p look at them, so greedy decoding
picks the likeliest allowed token. llguidance is an optional dependency (the `structured` extra,
also pulled in by `serve`): it is imported only when a constraint is used.
"""

from __future__ import annotations

import functools
import json
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from .errors import MlxLlamaError
from .tokenizer import Tokenizer

# Whitespace between JSON tokens, as llama.cpp's schema grammars allow it: one space, or one or two
# newlines and an indent of up to 20. Unbounded whitespace would let a model run to max_tokens in it.
JSON_WHITESPACE = r"( |\n{1,2}[ \t]{0,20})?"
KINDS = ("json_schema", "json_object", "regex", "grammar")
RECENT_MASKS = 32  # per generation, 4 KB each for a 32k vocabulary
NAMES = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex", "grammar": "grammar"}


class InvalidConstraint(MlxLlamaError):
    """A schema, regex or grammar the engine rejects; the message is one line naming the problem."""


@dataclass(frozen=True)
class Constraint:
    """What the output must match: `kind` is one of KINDS, `source` the schema (JSON text), the
    regex or the grammar (GBNF or llguidance's Lark); a json_object needs no source."""

    kind: str
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict | str) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidConstraint(f"JSON schema: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})")
        if not isinstance(schema, (dict, bool)):
            raise InvalidConstraint("JSON schema: expected a JSON object")
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        return cls("grammar", text)

    @classmethod
    def of(cls, kind: str, value: Any) -> Constraint:
        """From a keyword and its value, as `batch` lines and the Python API give them."""
        if kind == "json_schema":
            return cls.json_schema(value)
        if kind == "json_object":
            if value is not True:
                raise InvalidConstraint("json_object must be true")
            return cls.json_object()
        if kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise InvalidConstraint(f"{kind} must be a non-empty string")
            return cls(kind, value)
        raise InvalidConstraint(f"unknown constraint {kind!r} (known: {', '.join(KINDS)})")

    def llguidance_grammar(self) -> str:
        """The constraint in llguidance's grammar format (not yet checked: `Guide` compiles it)."""
        llguidance = engine()
        options = {"whitespace_pattern": JSON_WHITESPACE}
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, overrides=options)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        try:
            return llguidance.grammar_from("grammar", self.source)
        except ValueError as e:
            raise InvalidConstraint(f"grammar: {one_line(str(e))}") from None

    def check(self, tokenizer: Tokenizer) -> None:
        """Compile it once for this vocabulary, so a bad one is reported before generation starts."""
        Guide(self, tokenizer)


def engine():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 - the mask helpers live in a submodule
    except ImportError:
        raise MlxLlamaError("constrained generation needs llguidance: pip install 'mlxllama[structured]'") from None
    return llguidance


def one_line(message: str) -> str:
    return " ".join(message.split())


_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocabulary(tokenizer: Tokenizer):
    """Our vocabulary as llguidance sees it (built once per tokenizer): each token's decoded bytes.

    Tokens that decode to nothing (control, unknown, unused) are given their text behind a 0xff
    byte, llguidance's mark of a special token, so no text can match them. The tokens that end a
    generation are llguidance's EOS: it allows them where the constraint is complete.
    """
    if tokenizer not in _vocabularies:
        llguidance = engine()
        tokens = []
        for i in range(tokenizer.vocab_size):
            piece = tokenizer.token_bytes(i)
            if tokenizer.is_control(i) or not piece:
                piece = b"\xff" + tokenizer.id_to_piece(i).encode("utf-8")
            tokens.append(piece)
        _vocabularies[tokenizer] = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Encoder(tokenizer, tokens)), eos_token=sorted(tokenizer.stop_ids))
    return _vocabularies[tokenizer]


class _Encoder:
    """What llguidance's TokenizerWrapper reads: the tokens' bytes, EOS/BOS, and a tokenize call."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes]):
        self.tokenizer, self.tokens = tokenizer, tokens
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id
        self.special_token_ids = [i for i, t in enumerate(tokens) if t.startswith(b"\xff")]

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tokenizer.encode_continuation(text)


class Guide:
    """One generation's constraint: which tokens may come next, and the tokens that came."""

    def __init__(self, constraint: Constraint, tokenizer: Tokenizer):
        llguidance = engine()
        self.constraint = constraint
        self.vocab_size = tokenizer.vocab_size
        self.matcher = llguidance.LLMatcher(vocabulary(tokenizer), constraint.llguidance_grammar(), log_level=0)
        if self.matcher.is_error():
            raise InvalidConstraint(f"{NAMES[constraint.kind]}: {one_line(self.matcher.get_error())}")
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        self._fill = llguidance.numpy.fill_next_token_bitmask
        self._recent: OrderedDict[bytes, mx.array] = OrderedDict()  # masks' words on the device, newest last
        self._moved: list[bool] = []  # for each accepted token, whether the matcher took a new state (rollback)

    @functools.cached_property
    def _bits(self) -> mx.array:
        """Bit i of each 32-bit word, kept on the device: only the words cross from the host. Made
        at the first mask, so that compiling a constraint alone (Constraint.check, in a server's
        HTTP process) makes no MLX array."""
        bits = mx.arange(32, dtype=mx.uint32)
        mx.eval(bits)
        return bits

    def allowed_ids(self) -> np.ndarray:
        """A bool per token id: may it come next?"""
        self._fill(self.matcher, self._bitmask)
        return np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)

    def allowed(self, n_logits: int) -> mx.array:
        """The next token's mask over a model's n_logits outputs (ids past the vocabulary never
        allowed), unpacked on the device from llguidance's bitmask.

        On MLX's CUDA backend an array made on the host each step costs a transfer that the step
        waits for (an H100 measured 10-15% of a TinyLlama-shape step), so the host sends 4 bytes
        per 32 tokens, and none for a mask it sent lately: a JSON reply's masks repeat (inside a
        string, after a key, after a comma), and the last RECENT_MASKS are kept on the device."""
        self._fill(self.matcher, self._bitmask)
        key = self._bitmask.tobytes()
        words = self._recent.pop(key, None)
        if words is None:
            words = mx.array(self._bitmask[0].view(np.uint32))
            if len(self._recent) >= RECENT_MASKS:
                self._recent.popitem(last=False)
        self._recent[key] = words
        mask = ((words[:, None] >> self._bits) & 1).reshape(-1).astype(mx.bool_)
        if n_logits > mask.size:
            return mx.concatenate([mask, mx.zeros(n_logits - mask.size, mx.bool_)])
        return mask[:n_logits] if n_logits < mask.size else mask

    def accept(self, token_id: int) -> None:
        stopped = self.matcher.is_stopped()
        if not self.matcher.consume_token(token_id):
            raise MlxLlamaError(f"token {token_id} broke the {NAMES[self.constraint.kind]} constraint: "
                                f"{one_line(self.matcher.get_error())}")
        self._moved.append(not stopped)

    def rollback(self, n: int) -> None:
        """Forget the last n accepted tokens (speculative decoding's kept drafts, checked ahead)."""
        # A stopped matcher takes the stop token without a new state: rolling that back must not
        # undo the token before it.
        moved = sum(self._moved[len(self._moved) - n :])
        del self._moved[len(self._moved) - n :]
        self.matcher.rollback(moved)

    def allows_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, the constraint allows next (the guide stays where it is)."""
        n = self.matcher.try_consume_tokens(tokens)
        self.matcher.rollback(n)
        return n

    @property
    def complete(self) -> bool:
        """The output so far satisfies the constraint (it may or may not go on)."""
        return self.matcher.is_accepting()
