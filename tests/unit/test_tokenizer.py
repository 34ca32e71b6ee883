"""Tokenizer tests: llama.cpp's own test vectors, the chat-tiny prompt, decoding and streaming."""

from __future__ import annotations

import functools
import heapq
import random
from pathlib import Path

import numpy as np
import pytest

from mlxllama.errors import MlxLlamaError
from mlxllama.gguf_file import read_metadata
from mlxllama.tokenizer import StreamingDetokenizer, Tokenizer

from conftest import MISSING, PACKAGE_DATA, REPO_FIXTURES, SHARED

VOCAB_DIR = REPO_FIXTURES / "vocab"
# The byte-level BPE vocabularies (2 to 8 MB each) are read from ../shared when they are not copied here.
SHARED_VOCAB_DIR = SHARED / "vocab"
VOCABS = ("llama-spm", "phi-3")
BPE_VOCABS = ("llama-bpe", "qwen2", "gpt-2", "deepseek-llm")


def _vocab_path(name: str) -> Path | None:
    for directory in (VOCAB_DIR, SHARED_VOCAB_DIR):
        if (directory / f"ggml-vocab-{name}.gguf").is_file():
            return directory / f"ggml-vocab-{name}.gguf"
    return None


def _chat_tiny_path() -> Path:
    for path in (REPO_FIXTURES / "chat-tiny-Q4_K_M.gguf",
                 PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf"):
        if path.is_file():
            return path
    pytest.skip("chat-tiny-Q4_K_M.gguf not found")


# GGUFReader takes seconds for a 32k-string vocabulary: read each file once per session.
@functools.lru_cache(maxsize=None)
def _metadata(path: str) -> dict:
    return read_metadata(path)


@functools.lru_cache(maxsize=None)
def _tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_metadata(_metadata(path))


@pytest.fixture(scope="module")
def chat_tiny() -> Tokenizer:
    return _tokenizer(str(_chat_tiny_path()))


@pytest.fixture(scope="module")
def phi3() -> Tokenizer:
    return _tokenizer(str(VOCAB_DIR / "ggml-vocab-phi-3.gguf"))


# ---- llama.cpp's test-tokenizer-0 vectors ------------------------------------------------------

def _read_cases(name: str) -> list[tuple[str, list[int]]]:
    """Parse X.gguf.inp/.out exactly as llama.cpp's tests/test-tokenizer-0.cpp does."""
    path = _vocab_path(name)
    raw = Path(f"{path}.inp").read_bytes().decode("utf-8")
    sep = "\n__ggml_vocab_test__\n"
    inputs, pos = [], 0
    while pos < len(raw):  # the file ends with a separator, which yields no empty last case
        nxt = raw.find(sep, pos)
        if nxt == -1:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(sep)
    lines = Path(f"{path}.out").read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(inputs) == len(lines) == 46
    return [(text, [int(x) for x in line.split()]) for text, line in zip(inputs, lines)]


_CASES = [(name, i, text, ids) for name in VOCABS + BPE_VOCABS if _vocab_path(name)
          for i, (text, ids) in enumerate(_read_cases(name))]
_MISSING = [pytest.param(name, 0, "", [], id=f"{name}-missing",
                         marks=pytest.mark.skip(reason=f"{MISSING}: ggml-vocab-{name}.gguf in {SHARED_VOCAB_DIR}"))
            for name in VOCABS + BPE_VOCABS if not _vocab_path(name)]


def test_case_file_format():
    cases = dict(_read_cases("llama-spm"))
    # a case keeps its own newlines but not the one before the separator
    assert cases["\n"] == [29871, 13]
    assert cases["\t\n"] == [29871, 12, 13]
    assert cases["    Hello\n    Hello"] == [268, 15043, 13, 1678, 15043]
    assert cases[""] == []
    assert cases["Hello world"] == [15043, 3186]


@pytest.mark.parametrize("name,index,text,expected",
                         [pytest.param(*c, id=f"{c[0]}-{c[1]:02d}") for c in _CASES] + _MISSING)
def test_llama_cpp_vocab_cases(name, index, text, expected):
    tok = _tokenizer(str(_vocab_path(name)))
    assert tok.encode(text, add_bos=False, special=False) == expected


# ---- a port of llama.cpp's llm_tokenizer_spm_session, to cross-check sentencepiece ---------------

def _utf8_chars(data: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        c = data[i]
        n = 1 if c < 0x80 else 2 if c >> 5 == 6 else 3 if c >> 4 == 14 else 4 if c >> 3 == 30 else 1
        out.append(data[i:i + n])
        i += n
    return out


@functools.lru_cache(maxsize=None)
def _llama_cpp_tables(path: str) -> tuple[dict, dict, list[float]]:
    texts = _metadata(path)["tokenizer.ggml.tokens"]
    t2i = {t.encode(): i for i, t in enumerate(texts)}
    byte_id = {int(t[3:5], 16): i for i, t in enumerate(texts)
               if len(t) == 6 and t.startswith("<0x") and t.endswith(">")}
    return t2i, byte_id, [float(x) for x in _metadata(path)["tokenizer.ggml.scores"]]


def _llama_cpp_spm(path: str, text: str) -> list[int]:
    """llama.cpp's SPM merge loop (llm_tokenizer_spm_session) on one space-prefixed fragment."""
    t2i, byte_id, scores = _llama_cpp_tables(path)
    syms = [[c, i - 1, i + 1] for i, c in enumerate(_utf8_chars(text.replace(" ", "\u2581").encode()))]
    if not syms:
        return []
    syms[-1][2] = -1
    heap: list = []
    rev: dict = {}

    def add(left, right):
        if left == -1 or right == -1:
            return
        merged = syms[left][0] + syms[right][0]
        tid = t2i.get(merged)
        if tid is None:
            return
        heapq.heappush(heap, (-scores[tid], left, right, len(merged)))
        rev[merged] = (left, right)

    for i in range(1, len(syms)):
        add(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        a, b = syms[left], syms[right]
        if not a[0] or not b[0] or len(a[0]) + len(b[0]) != size:
            continue
        a[0], b[0] = a[0] + b[0], b""
        a[2] = b[2]
        if b[2] >= 0:
            syms[b[2]][1] = left
        add(a[1], left)
        add(left, a[2])

    out: list[int] = []

    def resegment(piece: bytes):
        tid = t2i.get(piece)
        if tid is not None:
            out.append(tid)
        elif piece in rev:
            resegment(syms[rev[piece][0]][0])
            resegment(syms[rev[piece][1]][0])
        else:
            out.extend(byte_id[x] for x in piece)

    i = 0
    while i != -1:
        resegment(syms[i][0])
        i = syms[i][2]
    return out


@pytest.mark.parametrize("name", VOCABS)
def test_matches_llama_cpp_merge_loop_on_random_text(name):
    path = str(VOCAB_DIR / f"ggml-vocab-{name}.gguf")
    tok = _tokenizer(path)
    alphabet = (list("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789     \n\n\t.,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`")
                + list("éüßñçøåœ日本語中文字한국어") + ["🦙", "😀", "👍🏽", "🇯🇵", "\u2581", "\u200d", "\r", "\x00",
                                                     "\u0301", "</s>", "<unk>", "<0x0A>", "[PAD32011]"])
    words = [w for text, _ in _read_cases(name) for w in text.split()]
    rng = random.Random(1234)
    checked = 0
    for k in range(400):
        if k % 2:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        else:
            text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 8)))
        if tok._partition(text, False) != [text]:
            continue  # only single-fragment texts: the port covers the merge loop, not the split
        assert tok.encode(text, add_bos=False) == _llama_cpp_spm(path, " " + text), repr(text)
        checked += 1
    assert checked > 350


# ---- the chat-tiny prompt (README of the fixtures) ------------------------------------------------

CHAT_PROMPT = "<|user|>\nWhat is the capital of Japan?</s>\n<|assistant|>\n"


def test_chat_tiny_prompt_with_special_tokens(chat_tiny):
    assert chat_tiny.encode(CHAT_PROMPT, add_bos=True, special=True) == [
        1, 529, 29989, 1792, 29989, 29958, 13, 5618, 338, 278, 7483, 310, 5546, 29973, 2,
        29871, 13, 29966, 29989, 465, 22137, 29989, 29958, 13]


def test_chat_tiny_prompt_without_special_tokens(chat_tiny):
    # "</s>" is plain text ("</" "s" ">"), and the "\n" after it gets no space prefix
    assert chat_tiny.encode(CHAT_PROMPT, add_bos=True, special=False) == [
        1, 529, 29989, 1792, 29989, 29958, 13, 5618, 338, 278, 7483, 310, 5546, 29973, 829, 29879, 29958,
        13, 29966, 29989, 465, 22137, 29989, 29958, 13]


def test_special_tokens_and_space_prefix(chat_tiny):
    assert chat_tiny.encode("</s>", add_bos=False, special=True) == [2]
    assert chat_tiny.encode("<s>Hello", add_bos=False, special=True) == [1, 15043]      # "▁Hello"
    assert chat_tiny.encode("Hello</s>Hello", add_bos=False, special=True) == [15043, 2, 15043]
    assert chat_tiny.encode("<s>Hello", add_bos=False, special=False) == [529, 29879, 29958, 10994]  # "Hello"
    assert chat_tiny.encode("<unk>", add_bos=False, special=True) == [0]


def test_vocab_attributes(chat_tiny):
    assert chat_tiny.vocab_size == 32000
    assert (chat_tiny.bos_id, chat_tiny.eos_id, chat_tiny.add_bos) == (1, 2, True)
    assert chat_tiny.stop_ids == frozenset({2})
    assert chat_tiny.special_token_text(1) == "<s>"
    assert chat_tiny.special_token_text(2) == "</s>"
    assert chat_tiny.id_to_piece(15043) == "▁Hello"
    assert chat_tiny.id_to_piece(13) == "<0x0A>"


def test_add_bos(chat_tiny):
    assert chat_tiny.encode("Hello world") == [1, 15043, 3186]
    assert chat_tiny.encode("Hello world", add_bos=False) == [15043, 3186]
    assert chat_tiny.encode("") == [1]
    assert chat_tiny.encode("", add_bos=False) == []
    meta = dict(_metadata(str(_chat_tiny_path())))
    meta["tokenizer.ggml.add_bos_token"] = False
    no_bos = Tokenizer.from_metadata(meta)
    assert no_bos.add_bos is False
    assert no_bos.encode("Hello world", add_bos=True) == [15043, 3186]


# ---- decoding ---------------------------------------------------------------------------------

def test_decode_round_trip(chat_tiny):
    for text in ["Hello world", "The capital of Japan is Tokyo.", "  two leading spaces", "日本語 🦙 café\n\tend",
                 "line1\nline2\n", "你好，世界", "😀👍🏽🇯🇵"]:
        assert chat_tiny.decode(chat_tiny.encode(text)) == text
    assert chat_tiny.decode(chat_tiny.encode("Hello world")) == "Hello world"


def test_decode_keeps_leading_space_without_bos(chat_tiny):
    # generated continuation of "The capital of Italy is": "▁Rome" "."
    assert chat_tiny.decode([9184, 29889]) == " Rome."
    assert chat_tiny.decode([1, 9184, 29889]) == "Rome."
    assert chat_tiny.decode([1, 29871, 29871, 9184]) == "  Rome"  # only one space is dropped
    assert chat_tiny.decode([]) == ""


def test_decode_byte_fallback_and_control_tokens(chat_tiny):
    assert chat_tiny.decode([13]) == "\n"                             # <0x0A>
    assert chat_tiny.decode([243, 162, 169, 156]) == "🦙"             # <0xF0><0x9F><0xA6><0x99>
    assert chat_tiny.decode([263, 243, 162, 29890]) == " a\ufffdb"    # "▁a", truncated UTF-8, "b"
    assert chat_tiny.decode([15043, 2, 0, 1, 3186]) == " Hello world"  # BOS/EOS/UNK render as nothing
    with pytest.raises(ValueError):
        chat_tiny.decode([32000])


# ---- streaming --------------------------------------------------------------------------------

def _stream(tok: Tokenizer, ids) -> list[str]:
    detok = StreamingDetokenizer(tok)
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_streaming_emits_complete_characters(chat_tiny):
    ids = chat_tiny.encode("Hi 🦙!", add_bos=True)
    assert ids == [1, 6324, 29871, 243, 162, 169, 156, 29991]
    assert _stream(chat_tiny, ids) == ["", "Hi", " ", "", "", "", "🦙", "!", ""]


@pytest.mark.parametrize("text", [
    "Hello 🦙 世界! ñ 👍🏽 🇯🇵 café\n\tend",
    "日本語のテキストと中文文本",
    "😀😃😄😁😆 emoji only 🧑‍🤝‍🧑",
    "mixed: αβγ кириллица עברית العربية 한국어 ✅",
])
def test_streaming_equals_decode(chat_tiny, text):
    for ids in (chat_tiny.encode(text), chat_tiny.encode(text, add_bos=False)):
        assert "".join(_stream(chat_tiny, ids)) == chat_tiny.decode(ids)
    assert "".join(_stream(chat_tiny, chat_tiny.encode(text))) == text


def test_streaming_equals_decode_on_random_ids(chat_tiny):
    rng = random.Random(7)
    pool = [0, 1, 2, 13, 29871, 15043, 3186, 30793] + list(range(3, 259))
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 12))]
        if rng.random() < 0.3:
            ids = [1] + ids
        assert "".join(_stream(chat_tiny, ids)) == chat_tiny.decode(ids), ids


def test_flush_returns_incomplete_bytes_as_replacement(chat_tiny):
    assert _stream(chat_tiny, [243, 162]) == ["", "", "\ufffd"]


# ---- Phi-3: user-defined "</s>" made CONTROL by llama.cpp, special tokens strip "\n" after them ----

def test_phi3_special_tokens(phi3):
    text = "<|user|>\nHi</s>\n<|end|>\n<|assistant|>\n"
    # llama.cpp marks Phi-3's special tokens RSTRIP: the "\n" after each is dropped; "▁Hi" = 6324
    assert phi3.encode(text, add_bos=True, special=True) == [1, 32010, 6324, 2, 32007, 32001]
    # without special parsing "</s>" (USER_DEFINED in the file, forced CONTROL as an EOG text) is text
    assert phi3.encode("Hi</s>", add_bos=False, special=False) == [6324, 829, 29879, 29958]
    assert phi3.stop_ids == frozenset({2, 32000, 32007})   # </s>, <|endoftext|>, <|end|>
    assert phi3.decode([1, 32010, 6324, 2, 32007]) == " Hi"


# ---- synthetic vocabularies -------------------------------------------------------------------

def _synthetic(extra: list[tuple[str, float, int]], **overrides) -> dict:
    """<unk> <s> </s>, 256 byte pieces, then `extra` (text, score, type)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    types = [2, 3, 3] + [6] * 256
    for text, score, typ in extra:
        tokens.append(text)
        scores.append(score)
        types.append(typ)
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": np.array(scores, dtype=np.float32),
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    meta.update(overrides)
    return meta


B = 259  # id of the first extra piece
_EXTRA = [("▁", -1.0, 1), ("a", -2.0, 1), ("b", -2.0, 1), ("<", -3.0, 1), ("s", -3.0, 1), (">", -3.0, 1),
          ("▁a", -1.5, 1), ("ab", -1.0, 1), ("<s", -2.5, 1), ("[X]", 0.0, 4), ("<|ctl|>", 0.0, 3),
          ("ba", -0.5, 5)]


def test_synthetic_user_defined_and_control():
    tok = Tokenizer.from_metadata(_synthetic(_EXTRA))
    x, ctl = B + 9, B + 10
    # USER_DEFINED is split out even without special parsing; text after it gets a space prefix:
    # "▁ab" -> "▁" + "ab" (score -1.0 beats "▁a" at -1.5)
    assert tok.encode("[X]ab", add_bos=False) == [x, B, B + 7]
    assert tok.encode("a[X]a", add_bos=False) == [B + 6, x, B + 6]
    # CONTROL only with special=True
    assert tok.encode("<|ctl|>a", add_bos=False, special=True) == [ctl, B + 6]
    assert tok.decode([x, ctl, B + 6]) == "[X] a"    # user-defined text is rendered raw, control not
    # llama.cpp looks merges up by text whatever the type: "<s" + ">" merges into <s> (CONTROL, id 1)
    assert tok.encode("<s>", add_bos=False, special=False) == [B, 1]
    # ... and into UNUSED pieces ("ba"), which render as nothing
    assert tok.encode("ba", add_bos=False) == [B, 11 + B]
    assert tok.decode([B + 11]) == ""
    # characters outside the vocabulary fall back to bytes
    assert tok.encode("aé", add_bos=False) == [B + 6, 3 + 0xC3, 3 + 0xA9]


def test_synthetic_flags():
    tok = Tokenizer.from_metadata(_synthetic(_EXTRA, **{"tokenizer.ggml.add_space_prefix": False,
                                                        "tokenizer.ggml.add_eos_token": True}))
    assert tok.encode("ab") == [1, B + 7, 2]
    assert tok.encode("ab", add_bos=False) == [B + 7]
    assert tok.decode([1, B, B + 1]) == " a"         # no space prefix: nothing to drop


def test_synthetic_without_byte_fallback():
    meta = _synthetic(_EXTRA)
    keep = [i for i, t in enumerate(meta["tokenizer.ggml.tokens"]) if not t.startswith("<0x")]
    meta["tokenizer.ggml.tokens"] = [meta["tokenizer.ggml.tokens"][i] for i in keep]
    meta["tokenizer.ggml.scores"] = meta["tokenizer.ggml.scores"][keep]
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"][keep]
    tok = Tokenizer.from_metadata(meta)
    assert tok.encode("aé", add_bos=False) == [3 + 6, 0]     # unknown character -> <unk>


def test_errors():
    with pytest.raises(MlxLlamaError, match="'bert'"):
        Tokenizer.from_metadata(_synthetic([], **{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(MlxLlamaError, match="tokenizer.ggml.merges"):
        Tokenizer.from_metadata(_synthetic([], **{"tokenizer.ggml.model": "gpt2"}))
    with pytest.raises(MlxLlamaError, match="'gpt-5'.*supported:.*llama-bpe"):
        Tokenizer.from_metadata(_synthetic([], **{"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-5",
                                                   "tokenizer.ggml.merges": []}))
    with pytest.raises(MlxLlamaError) as e:
        Tokenizer.from_metadata({"general.architecture": "llama"})
    assert "\n" not in str(e.value)
    meta = _synthetic([])
    del meta["tokenizer.ggml.tokens"]
    with pytest.raises(MlxLlamaError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata(meta)
    with pytest.raises(MlxLlamaError, match="duplicate"):
        Tokenizer.from_metadata(_synthetic([("a", 0.0, 1), ("a", 0.0, 1)]))
