"""GGUF tokenizers, tokenizing like llama.cpp: SentencePiece ("llama") and byte-level BPE ("gpt2").

Byte-level BPE segmentation lives in ``bpe.py``; this module handles what both kinds share (special
tokens, BOS/EOS, end-of-generation ids, decoding tables).  For SentencePiece vocabularies:

The raw-text segmentation is done by the ``sentencepiece`` library (``sentencepiece_model.py``) with a model
assembled in memory from the GGUF vocabulary (a hand-serialized ``ModelProto``; no protobuf
dependency).  Everything around it follows llama.cpp's ``llama-vocab.cpp`` rather than
sentencepiece's own conventions:

* special tokens are split out of the text first (``tokenizer_st_partition``): every CONTROL,
  USER_DEFINED or UNKNOWN token, longest first; with ``special=False`` only USER_DEFINED ones;
* a space is prepended (``add_space_prefix``) to a text fragment that starts the input or follows
  a special token, and to no other fragment;
* llama.cpp's merge loop looks pieces up by text whatever their type, so every piece except the
  byte pieces is given to sentencepiece as NORMAL (sentencepiece would otherwise keep
  CONTROL/UNKNOWN pieces out of merges, resegment UNUSED ones and force USER_DEFINED ones);
* decoding renders pieces the way ``llama_token_to_piece(..., special=false)`` does.
"""

from __future__ import annotations

import codecs
from typing import Any, Mapping, Sequence

import numpy as np

from . import bpe
from .errors import MlxLlamaError
from .sentencepiece_model import SentencePieceEncoder, byte_of_piece

__all__ = ["Tokenizer", "StreamingDetokenizer"]

# tokenizer.ggml.token_type values (llama_token_type)
TYPE_UNDEFINED = 0
TYPE_NORMAL = 1
TYPE_UNKNOWN = 2
TYPE_CONTROL = 3
TYPE_USER_DEFINED = 4
TYPE_UNUSED = 5
TYPE_BYTE = 6

# llama_token_attr bit flags: llama.cpp turns the type into flags and then adds some by token text
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

_TYPE_TO_ATTR = {
    TYPE_UNDEFINED: ATTR_UNDEFINED,
    TYPE_NORMAL: ATTR_NORMAL,
    TYPE_UNKNOWN: ATTR_UNKNOWN,
    TYPE_CONTROL: ATTR_CONTROL,
    TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TYPE_UNUSED: ATTR_UNUSED,
    TYPE_BYTE: ATTR_BYTE,
}

# Texts llama.cpp treats as end-of-generation; it also forces them to CONTROL
# (llama_vocab::impl::load, "special_eog_ids").
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
# Texts llama.cpp auto-detects as the EOT token when the metadata names none.
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)
# Texts that llama.cpp auto-detects as FIM tokens (and forces to CONTROL) when the metadata
# does not name that FIM token.  key suffixes: the current name first, then the deprecated one.
_FIM_TEXTS = (
    (("fim_pre_token_id", "prefix_token_id"),
     ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
      "<|code_prefix|>", "<|prefix|>")),
    (("fim_suf_token_id", "suffix_token_id"),
     ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
      "<|code_suffix|>", "<|suffix|>")),
    (("fim_mid_token_id", "middle_token_id"),
     ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
      "<|code_middle|>", "<|middle|>")),
    (("fim_pad_token_id",), ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    (("fim_rep_token_id",), ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    (("fim_sep_token_id",), ("<|file_sep|>",)),
)
_FIM_EOG = ("fim_pad_token_id", "fim_rep_token_id", "fim_sep_token_id")

_SPACE = "\u2581"  # ▁, SentencePiece's whitespace symbol
_CSPACE = " \t\n\v\f\r"  # C isspace(), used by llama.cpp's lstrip/rstrip of special tokens
_KEY = "tokenizer.ggml."


def _get(metadata: Mapping[str, Any], name: str, default: Any = None) -> Any:
    return metadata.get(_KEY + name, default)


def _opt_id(metadata: Mapping[str, Any], name: str, default: int | None, n_vocab: int) -> int | None:
    """A special token id as llama.cpp resolves it: metadata if in range, else the default."""
    if default is not None and not 0 <= default < n_vocab:
        default = None
    value = _get(metadata, name)
    if value is None:
        return default
    value = int(value)
    return value if 0 <= value < n_vocab else default


class Tokenizer:
    """A llama.cpp-compatible tokenizer for ``tokenizer.ggml.model`` "llama" (SPM) or "gpt2" (BPE)."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    eot_id: int | None
    eom_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    stop_ids: frozenset[int]

    def __init__(self) -> None:  # use from_metadata()
        raise TypeError("use Tokenizer.from_metadata(metadata)")

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        model = _get(metadata, "model")
        if model is None:
            raise MlxLlamaError("GGUF metadata has no tokenizer (tokenizer.ggml.model is missing)")
        if model not in ("llama", "gpt2"):
            raise MlxLlamaError(
                f"unsupported tokenizer model {model!r}: supported are SentencePiece ('llama') and byte-level"
                " BPE ('gpt2') vocabularies")
        raw_tokens = _get(metadata, "tokens")
        if raw_tokens is None or len(raw_tokens) == 0:
            raise MlxLlamaError("GGUF metadata has no vocabulary (tokenizer.ggml.tokens is missing)")
        self = object.__new__(cls)
        self._build(metadata, [str(t) for t in raw_tokens])
        return self

    # ---- construction ----------------------------------------------------------------------

    def _build(self, metadata: Mapping[str, Any], raw_tokens: list[str]) -> None:
        n = len(raw_tokens)
        self.vocab_size = n
        self._raw = raw_tokens

        scores = _get(metadata, "scores")
        if scores is None:
            scores = np.zeros(n, dtype=np.float32)
        scores = np.asarray(scores).astype(np.float32, copy=False)
        types = _get(metadata, "token_type")
        if types is None:
            types = np.full(n, TYPE_NORMAL, dtype=np.int32)
        types = np.asarray(types).astype(np.int64, copy=False)
        if len(scores) < n or len(types) < n:
            raise MlxLlamaError("GGUF metadata: tokenizer.ggml.scores/token_type are shorter than the vocabulary")

        # token text as llama.cpp keeps it: C string (cut at NUL), "[EMPTY_i]" for empty ones
        texts: list[str] = []
        token_to_id: dict[str, int] = {}
        for i, t in enumerate(raw_tokens):
            t = t.split("\0", 1)[0]
            if not t:
                t = f"[EMPTY_{i}]"
            if t in token_to_id:
                raise MlxLlamaError(
                    f"GGUF vocabulary has a duplicate token {t!r} (ids {token_to_id[t]} and {i})")
            token_to_id[t] = i
            texts.append(t)
        self._texts = texts
        self._token_to_id = token_to_id

        attrs = [_TYPE_TO_ATTR.get(int(x), ATTR_UNDEFINED) for x in types[:n]]

        # llama.cpp's defaults differ by kind: BPE vocabularies have no <unk>, add no space prefix,
        # and add BOS only where the pre-tokenizer says so (Llama 3) or the metadata asks.
        is_bpe = _get(metadata, "model") == "gpt2"
        if is_bpe:
            self._bpe = bpe.BytePairEncoder.from_metadata(metadata, token_to_id)
        self.kind = "bpe" if is_bpe else "spm"
        self.bos_id = _opt_id(metadata, "bos_token_id", 11 if is_bpe else 1, n)
        self.eos_id = _opt_id(metadata, "eos_token_id", 11 if is_bpe else 2, n)
        self.unk_id = _opt_id(metadata, "unknown_token_id", None if is_bpe else 0, n)
        self.pad_id = _opt_id(metadata, "padding_token_id", None, n)
        self.eot_id = _opt_id(metadata, "eot_token_id", None, n)
        self.eom_id = _opt_id(metadata, "eom_token_id", None, n)
        self.add_bos = bool(_get(metadata, "add_bos_token", self._bpe.pre.add_bos if is_bpe else True))
        self.add_eos = bool(_get(metadata, "add_eos_token", False))
        self.add_space_prefix = not is_bpe and bool(_get(metadata, "add_space_prefix", True))
        if self.add_bos and self.bos_id is None:
            raise MlxLlamaError("tokenizer.ggml.add_bos_token is true, but the BOS token id is not valid")
        if self.add_eos and self.eos_id is None:
            raise MlxLlamaError("tokenizer.ggml.add_eos_token is true, but the EOS token id is not valid")

        # llama.cpp's text-based fix-ups: FIM and end-of-generation tokens become CONTROL
        fim_ids: dict[str, int | None] = {}
        for keys, candidates in _FIM_TEXTS:
            found = None
            for key in keys:
                found = _opt_id(metadata, key, None, n)
                if found is not None:
                    break
            if found is None:
                hits = [token_to_id[c] for c in candidates if c in token_to_id]
                if hits:
                    found = min(hits)
                    attrs[found] |= ATTR_CONTROL
            fim_ids[keys[0]] = found
        if self.eot_id is None:
            # llama.cpp takes the first match in hash-map order; the list's order (the texts' specificity)
            # gives the same answer on Llama 3, Qwen2 and Phi-3 vocabularies, which hold several.
            self.eot_id = next((token_to_id[t] for t in _EOT_TEXTS if t in token_to_id), None)
        if self.eom_id is None and "<|eom_id|>" in token_to_id:
            self.eom_id = token_to_id["<|eom_id|>"]
        eog = {token_to_id[t] for t in _EOG_TEXTS if t in token_to_id}
        eog.update(fim_ids[k] for k in _FIM_EOG if fim_ids[k] is not None)
        for tid in eog:  # (text-detected EOT/EOM ids are EOG texts too)
            attrs[tid] |= ATTR_CONTROL
        eog.update(t for t in (self.eos_id, self.eot_id, self.eom_id) if t is not None)
        self.stop_ids = frozenset(eog)

        # special-token cache (CONTROL | USER_DEFINED | UNKNOWN), longest UTF-8 text first
        special = [i for i in range(n) if attrs[i] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        special.sort(key=lambda i: (-len(texts[i].encode("utf-8")), i))

        # per-model attributes (llama.cpp: Phi-3 special tokens eat the whitespace after them)
        name = str(metadata.get("general.name", "")).lower()
        if "phi-3" in name or "phi3" in name:
            for i in special:
                attrs[i] |= ATTR_RSTRIP
            if "</s>" in token_to_id:
                attrs[token_to_id["</s>"]] |= ATTR_RSTRIP
            for t in ("<unk>", "<s>", "<|endoftext|>"):
                if t in token_to_id:
                    attrs[token_to_id[t]] &= ~ATTR_RSTRIP
        self._attrs = attrs
        self._special_all = [(texts[i], i, attrs[i]) for i in special]
        self._special_user = [s for s in self._special_all if not s[2] & (ATTR_CONTROL | ATTR_UNKNOWN)]

        # decode table: what llama_token_to_piece(id, special=false) renders
        pieces: list[bytes] = []
        for i in range(n):
            a = attrs[i]
            if a & (ATTR_CONTROL | ATTR_UNKNOWN):
                pieces.append(b"")
            elif a & ATTR_USER_DEFINED:
                pieces.append(texts[i].encode("utf-8"))
            elif a & ATTR_NORMAL:
                pieces.append(bpe.byte_decode(texts[i]) if is_bpe else texts[i].replace(_SPACE, " ").encode("utf-8"))
            elif a & ATTR_BYTE:
                b = byte_of_piece(texts[i])
                pieces.append(bytes([b]) if b is not None else b"")
            else:  # UNUSED, UNDEFINED
                pieces.append(b"")
        self._pieces = pieces

        if not is_bpe:
            byte_types = types[:n] == TYPE_BYTE
            self._sp = SentencePieceEncoder(texts, scores[:n], byte_types, self.unk_id)

    # ---- encoding ---------------------------------------------------------------------------

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """llama.cpp's tokenizer_st_partition: split text on special tokens, longest first."""
        fragments: list[str | int] = [text]
        for tok_text, tid, attr in (self._special_all if special else self._special_user):
            if tok_text not in text:
                continue
            new: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or tok_text not in frag:
                    new.append(frag)
                    continue
                parts = frag.split(tok_text)
                last = len(parts) - 1
                for k, part in enumerate(parts):
                    if k > 0 and attr & ATTR_RSTRIP:
                        part = part.lstrip(_CSPACE)
                    if k < last and attr & ATTR_LSTRIP:
                        part = part.rstrip(_CSPACE)
                    if part:
                        new.append(part)
                    if k < last:
                        new.append(tid)
            fragments = new
        return fragments

    def _encode_fragment(self, text: str) -> list[int]:
        return self._bpe.encode(text) if self.kind == "bpe" else self._sp.encode(text)

    def encode(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids for ``text``, as ``llama_tokenize(text, add_special=add_bos, parse_special=special)``.

        BOS is prepended only when ``add_bos`` and the vocabulary's add_bos flag are both set (and
        EOS appended when ``add_bos`` and the vocabulary's add_eos flag are set, as llama.cpp does).
        """
        out: list[int] = []
        add_special = add_bos
        if add_special and self.add_bos:
            out.append(self.bos_id)  # type: ignore[arg-type]
        if text:
            prev_special = True  # the first fragment gets the space prefix too
            for frag in self._partition(text, special):
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                else:
                    if self.add_space_prefix and prev_special:
                        frag = " " + frag
                    out.extend(self._encode_fragment(frag))
                    prev_special = False
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids for ``text`` as it continues text before it: no BOS, and no space prefix.

        What a constraint engine needs to turn the bytes a grammar forces into tokens that decode
        to exactly those bytes (``encode`` would put SentencePiece's space in front).
        """
        out: list[int] = []
        for frag in self._partition(text, special=False):
            out.extend([frag] if isinstance(frag, int) else self._encode_fragment(frag))
        return out

    # ---- decoding ---------------------------------------------------------------------------

    def _check_id(self, id: int) -> int:
        id = int(id)
        if not 0 <= id < self.vocab_size:
            raise ValueError(f"token id {id} is out of range (vocabulary size {self.vocab_size})")
        return id

    def token_bytes(self, id: int) -> bytes:
        """The bytes token ``id`` renders as in decoded text (b"" for control tokens)."""
        return self._pieces[self._check_id(id)]

    def decode(self, ids: Sequence[int]) -> str:
        ids = [self._check_id(i) for i in ids]
        if not ids:
            return ""
        pieces = self._pieces
        chunks = [pieces[i] for i in ids]
        # llama.cpp drops the space that add_space_prefix put in front of the text after BOS
        if len(ids) > 1 and ids[0] == self.bos_id and self.add_space_prefix and chunks[1].startswith(b" "):
            chunks[1] = chunks[1][1:]
        return b"".join(chunks).decode("utf-8", errors="replace")

    def decode_with_special_tokens(self, ids: Sequence[int]) -> str:
        """``decode``, but control tokens spelled out (``llama_token_to_piece(..., special=true)``):
        what a reader of tool calls needs, whose markers ([TOOL_CALLS], <|python_tag|>) are control tokens."""
        pieces = [self._texts[i].encode("utf-8") if self._attrs[i] & ATTR_CONTROL else self._pieces[i]
                  for i in map(self._check_id, ids)]
        return b"".join(pieces).decode("utf-8", errors="replace")

    def control_id(self, text: str) -> int | None:
        """The id of the control token spelled `text`, if the vocabulary has one."""
        token = self._token_to_id.get(text)
        return token if token is not None and self.is_control(token) else None

    def id_to_piece(self, id: int) -> str:
        """The raw vocabulary string of token ``id`` (e.g. "▁Hello", "<0x0A>", "</s>")."""
        return self._raw[self._check_id(id)]

    def special_token_text(self, id: int | None) -> str:
        """The text of a special token, e.g. "</s>" (for templates' bos_token/eos_token); "" for None."""
        if id is None:
            return ""
        return self._raw[self._check_id(id)]

    def is_control(self, id: int) -> bool:
        return bool(self._attrs[self._check_id(id)] & ATTR_CONTROL)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
                f"add_bos={self.add_bos}, add_space_prefix={self.add_space_prefix})")


class StreamingDetokenizer:
    """Incremental ``Tokenizer.decode``: ``"".join(add(i) for i in ids) + flush() == decode(ids)``.

    Bytes of a UTF-8 character split over several (byte-fallback) tokens are held back until the
    character is complete; O(1) work per token.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._count = 0
        self._strip_next = False

    def add(self, id: int) -> str:
        tok = self._tok
        data = tok.token_bytes(id)
        self._count += 1
        if self._count == 1:
            self._strip_next = id == tok.bos_id and tok.add_space_prefix
        elif self._strip_next:
            self._strip_next = False
            if data.startswith(b" "):
                data = data[1:]
        return self._decoder.decode(data)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
