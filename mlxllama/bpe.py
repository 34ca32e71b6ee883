"""Byte-level BPE (GGUF ``tokenizer.ggml.model == "gpt2"``: Llama 3, Qwen2, GPT-2, DeepSeek), as llama.cpp does it.

A text fragment is split into words by the pre-tokenizer that ``tokenizer.ggml.pre`` names (a list
of regexes applied one after the other, each splitting every piece left by the previous one into
its matches and the gaps between them), each word's UTF-8 bytes are mapped to GPT-2's printable
byte alphabet, and the word is merged by rank, lowest first, the leftmost pair among equals.

llama.cpp classifies characters with its own Unicode tables and runs its regexes with ASCII-only
classes on a "collapsed" copy of the text, where every non-ASCII character stands for its category
(and non-ASCII whitespace for "\\v"); doing the same here with ``unicodedata`` gives its splits
(including where they differ from a Unicode-aware regex engine) without a regex dependency.
"""

from __future__ import annotations

import functools
import heapq
import re
import unicodedata
from dataclasses import dataclass
from typing import Mapping, Sequence

from .errors import MlxLlamaError

# llama.cpp's pre-tokenizer regexes (llm_tokenizer_bpe), written as it writes them (non-ASCII as
# escapes: editors may normalize characters such as U+1F7D, and a range's end with them).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_DEEPSEEK_LLM = (
    r"[\r\n]",
    (r"\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
     r"\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
     r"\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
     r"\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
     r"\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
     r"\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
     r"\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
     r"\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
     r"\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
     r"\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"),
    r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_STARCODER = (r"\p{N}", _GPT2)


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    # A word that is itself a token is kept whole, whatever the merges would make of it.
    ignore_merges: bool = False
    # llama.cpp's add_bos default for the vocabulary (tokenizer.ggml.add_bos_token overrides it).
    add_bos: bool = False


_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
# tokenizer.ggml.pre -> how llama.cpp pre-tokenizes (llama_vocab::impl::load)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(_DEFAULT),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _LLAMA3_PRE),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), PreTokenizer((_QWEN2,))),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais"), PreTokenizer((_GPT2,))),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell"), PreTokenizer(_STARCODER)),
    "deepseek-llm": PreTokenizer(_DEEPSEEK_LLM),
}

# What a non-ASCII character collapses to, by Unicode category (llama.cpp's k_ucat_cpt).
_UNDEFINED, _NUMBER, _LETTER, _PUNCTUATION, _MARK, _SYMBOL = "\xd0", "\xd1", "\xd2", "\xd3", "\xd4", "\xd5"
_CATEGORY_CHAR = {"N": _NUMBER, "L": _LETTER, "P": _PUNCTUATION, "M": _MARK, "S": _SYMBOL}
# A class's collapsed character plus its ASCII members (llama.cpp's k_ucat_map).
_CATEGORY_CLASS = {
    "N": _NUMBER + "0-9",
    "L": _LETTER + "A-Za-z",
    "P": _PUNCTUATION + r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    "M": _MARK,
    "S": _SYMBOL + r"\$\+<->\^`\|~",
}
# llama.cpp's whitespace set; its regexes' \s is ASCII-only, so the others become "\v".
_WHITESPACE = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009"
                        "\u200a\u2028\u2029\u202f\u205f\u3000")


@functools.lru_cache(maxsize=None)
def _collapsed_char(c: str) -> str:
    if c in _WHITESPACE:
        return "\v"
    return _CATEGORY_CHAR.get(unicodedata.category(c)[0], _UNDEFINED)


def _collapse(text: str) -> str:
    return "".join(c if c < "\x80" else _collapsed_char(c) for c in text)


def _spaces_to_vt(text: str) -> str:
    return "".join("\v" if c > "\x7f" and c in _WHITESPACE else c for c in text)


_CATEGORY = re.compile(r"\\p\{([A-Z])\}")


@functools.lru_cache(maxsize=None)
def _compile(regex: str) -> tuple[re.Pattern, bool]:
    """The regex as Python's `re` runs it, and whether it runs on the collapsed text.

    \\p{X} becomes the class of X's collapsed character and ASCII members (bracketed unless it is
    inside a class already); `$` means the end of the piece, as in ECMAScript.
    """
    collapsed = _CATEGORY.search(regex) is not None
    out, inside, i = [], False, 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            m = _CATEGORY.match(regex, i)
            if m:
                members = _CATEGORY_CLASS[m.group(1)]
                out.append(members if inside else f"[{members}]")
                i = m.end()
                continue
            out.append(regex[i:i + 2])
            i += 2
            continue
        if c == "[":
            inside = True
        elif c == "]":
            inside = False
        elif c == "$" and not inside:
            c = r"\Z"
        out.append(c)
        i += 1
    return re.compile("".join(out), re.ASCII), collapsed


def pre_tokenize(text: str, regexes: Sequence[str]) -> list[str]:
    """Split text into words: each regex splits every piece into its matches and the gaps between."""
    pieces = [(0, len(text))] if text else []
    views: dict[bool, str] = {}
    for regex in regexes:
        pattern, collapsed = _compile(regex)
        if collapsed not in views:
            views[collapsed] = _collapse(text) if collapsed else _spaces_to_vt(text)
        view, split = views[collapsed], []
        for start, end in pieces:
            piece, at = view[start:end], 0
            for m in pattern.finditer(piece):
                if m.start() > at:
                    split.append((start + at, start + m.start()))
                if m.end() > m.start():
                    split.append((start + m.start(), start + m.end()))
                at = m.end()
            if at < len(piece):
                split.append((start + at, end))
        pieces = split
    return [text[start:end] for start, end in pieces]


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table: printable Latin-1 maps to itself, the rest to U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_TO_CHAR = _byte_alphabet()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


def byte_decode(text: str) -> bytes:
    """A token's text back to the bytes it stands for (llama_decode_text, unknown characters included)."""
    out = bytearray()
    for c in text:
        b = CHAR_TO_BYTE.get(c)
        if b is not None:
            out.append(b)
        else:
            utf8 = c.encode("utf-8", "surrogatepass")
            out += b"[UNK_BYTE_0x" + utf8.hex().encode() + text.encode("utf-8", "surrogatepass") + b"]"
    return bytes(out)


class BytePairEncoder:
    """Pre-tokenizer plus merges for one vocabulary; `encode` takes one text fragment (no special tokens)."""

    _CACHE_LIMIT = 1 << 16

    def __init__(self, pre: PreTokenizer, merges: Sequence[str], token_to_id: Mapping[str, int]):
        self.pre = pre
        self._token_to_id = token_to_id
        ranks = {}
        for rank, merge in enumerate(merges):
            # llama.cpp splits at the first space after the first character (a merge may start with one).
            cut = merge.find(" ", 1)
            pair = (merge[:cut], merge[cut + 1:]) if cut != -1 else ("", "")
            ranks.setdefault(pair, rank)
        self._ranks = ranks
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_metadata(cls, metadata: Mapping, token_to_id: Mapping[str, int]) -> "BytePairEncoder":
        name = metadata.get("tokenizer.ggml.pre") or "default"
        if name not in PRE_TOKENIZERS:
            raise MlxLlamaError(
                f"unsupported BPE pre-tokenizer {name!r} (tokenizer.ggml.pre); supported: {', '.join(sorted(PRE_TOKENIZERS))}")
        merges = metadata.get("tokenizer.ggml.merges")
        if merges is None:
            raise MlxLlamaError("GGUF metadata has no BPE merges (tokenizer.ggml.merges is missing)")
        return cls(PRE_TOKENIZERS[name], merges, token_to_id)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for word in pre_tokenize(text, self.pre.regexes):
            encoded = "".join(BYTE_TO_CHAR[b] for b in word.encode("utf-8", "surrogatepass"))
            ids = self._cache.get(encoded)
            if ids is None:
                ids = self._word_ids(encoded)
                if len(self._cache) >= self._CACHE_LIMIT:
                    self._cache.clear()
                self._cache[encoded] = ids
            out.extend(ids)
        return out

    def _word_ids(self, word: str) -> list[int]:
        token_to_id = self._token_to_id
        if self.pre.ignore_merges and word in token_to_id:
            return [token_to_id[word]]
        ids = []
        for symbol in self._merge(word):
            tid = token_to_id.get(symbol)
            if tid is not None:
                ids.append(tid)
                continue
            # llama.cpp then looks each byte of the symbol's UTF-8 up as a one-byte token text,
            # which only ASCII can be; the rest is dropped.
            ids.extend(token_to_id[chr(b)] for b in symbol.encode("utf-8") if b < 0x80 and chr(b) in token_to_id)
        return ids

    def _merge(self, word: str) -> list[str]:
        """Apply merges lowest rank first, the leftmost pair among equal ranks (llm_tokenizer_bpe_session)."""
        symbols = list(word)
        n = len(symbols)
        prev, nxt = list(range(-1, n - 1)), list(range(1, n + 1))
        nxt[-1] = -1
        ranks, heap = self._ranks, []

        def push(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                rank = ranks.get((symbols[left], symbols[right]))
                if rank is not None:
                    heapq.heappush(heap, (rank, left, right, symbols[left] + symbols[right]))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, text = heapq.heappop(heap)
            if not symbols[left] or not symbols[right] or symbols[left] + symbols[right] != text:
                continue  # one side has changed since this pair was queued
            symbols[left], symbols[right] = text, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        return [s for s in symbols if s]
