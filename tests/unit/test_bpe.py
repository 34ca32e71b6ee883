"""Byte-level BPE tokenizers: pre-tokenizer splits, the merge loop, special tokens, decoding and streaming.

llama.cpp's own test vectors for these vocabularies run in test_tokenizer.py; the tokenizers here
come from the llama3/qwen2 fixtures (cut-down Llama 3 and Qwen2 vocabularies, always in the repo).
"""

from __future__ import annotations

import functools
import random

import pytest

from mlxllama.bpe import BYTE_TO_CHAR, PRE_TOKENIZERS, byte_decode, pre_tokenize
from mlxllama.runtime import load_tokenizer
from mlxllama.tokenizer import StreamingDetokenizer

from conftest import find_fixture_model


@functools.lru_cache(maxsize=None)
def tokenizer(name: str):
    return load_tokenizer(find_fixture_model(name))


@pytest.fixture
def llama3():
    return tokenizer("llama3-tiny-Q6_K.gguf")


@pytest.fixture
def qwen2():
    return tokenizer("qwen2-tiny-Q8_0.gguf")


def split(name: str, text: str) -> list[str]:
    return pre_tokenize(text, PRE_TOKENIZERS[name].regexes)


def test_llama3_pre_tokenizer():
    assert split("llama-bpe", "Hello world") == ["Hello", " world"]
    # digits in threes, contractions of either case, punctuation with its trailing newlines
    assert split("llama-bpe", "1234567 I'M you'll") == ["123", "456", "7", " I", "'M", " you", "'ll"]
    assert split("llama-bpe", "ok!!\n\nnext") == ["ok", "!!\n\n", "next"]
    # whitespace runs leave their last space to the word after them; newlines end a run
    assert split("llama-bpe", "a   b\t\n c") == ["a", "  ", " b", "\t\n", " c"]
    # letters of any script, and non-ASCII whitespace (no-break space) as whitespace
    assert split("llama-bpe", "naïve 東京\u00a0x") == ["naïve", " 東京", "\u00a0x"]


def test_qwen2_and_gpt2_pre_tokenizers():
    assert split("qwen2", "1234 abc") == ["1", "2", "3", "4", " abc"]
    assert split("gpt-2", "Hello  world 123 it's") == ["Hello", " ", " world", " 123", " it", "'s"]
    assert split("gpt-2", "it'S") == ["it", "'", "S"]  # GPT-2's contractions are lower-case only


def test_deepseek_llm_pre_tokenizer():
    # a sequence of regexes, each splitting what the previous left; `$` is the end of a piece
    assert split("deepseek-llm", "Hi there 123\n  ") == ["Hi", " there", " ", "123", "\n", "  "]
    assert split("deepseek-llm", "中文abc") == ["中文", "abc"]


def test_byte_alphabet():
    assert BYTE_TO_CHAR[ord("A")] == "A" and BYTE_TO_CHAR[ord(" ")] == "Ġ" and BYTE_TO_CHAR[ord("\n")] == "Ċ"
    assert len(set(BYTE_TO_CHAR)) == 256
    assert byte_decode("ĠHello") == b" Hello"
    assert byte_decode("x\u4e00") == b"x[UNK_BYTE_0xe4b880x\xe4\xb8\x80]"  # as llama.cpp renders it


def _naive_merge(ranks: dict, word: str) -> list[str]:
    """Textbook BPE: merge the lowest-ranked adjacent pair, the leftmost of equals, until none is left."""
    symbols = list(word)
    while True:
        pairs = [(ranks.get((a, b)), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
        pairs = [p for p in pairs if p[0] is not None]
        if not pairs:
            return symbols
        _, i = min(pairs)
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]


def test_merge_loop_matches_textbook_bpe(llama3):
    encoder = llama3._bpe
    rng = random.Random(5)
    alphabet = "abcdeilnorst ĠĊ" + "".join(BYTE_TO_CHAR[b] for b in range(0xC0, 0xC8))
    for _ in range(300):
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24)))
        assert encoder._merge(word) == _naive_merge(encoder._ranks, word), word


def test_llama3_special_tokens(llama3):
    text = "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    ids = llama3.encode(text, special=True)
    assert ids[0] == llama3.bos_id and llama3.id_to_piece(ids[0]) == "<|begin_of_text|>"
    assert [llama3.id_to_piece(i) for i in (ids[1], ids[3], ids[-1])] == [
        "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    # without special parsing the control tokens are plain text
    plain = llama3.encode("<|eot_id|>", add_bos=False)
    assert len(plain) > 1 and not any(llama3.is_control(i) for i in plain)
    assert llama3.decode(plain) == "<|eot_id|>"
    assert llama3.add_bos and not llama3.add_space_prefix
    assert {llama3.id_to_piece(i) for i in llama3.stop_ids} == {"<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"}
    assert llama3.id_to_piece(llama3.eot_id) == "<|eot_id|>"  # as llama.cpp resolves it here
    assert llama3.special_token_text(llama3.bos_id) == "<|begin_of_text|>"
    assert llama3.decode(ids) == "user\n\nHi"  # control tokens render as nothing


def test_qwen2_special_tokens(qwen2):
    ids = qwen2.encode("<|im_start|>user\nHi<|im_end|>", special=True)
    assert not qwen2.add_bos and qwen2.id_to_piece(ids[0]) == "<|im_start|>"
    assert {qwen2.id_to_piece(i) for i in qwen2.stop_ids} == {"<|im_end|>", "<|endoftext|>"}
    assert qwen2.id_to_piece(qwen2.eot_id) == "<|im_end|>"


@pytest.mark.parametrize("text", ["Hello world", "naïve café, 東京 🦙 — it's 3.14!\n\tend", "😀👍🏽🇯🇵", "  x  "])
def test_decode_and_stream(llama3, qwen2, text):
    for tok in (llama3, qwen2):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        detok = StreamingDetokenizer(tok)
        pieces = [detok.add(i) for i in ids] + [detok.flush()]
        assert "".join(pieces) == text
        assert "\ufffd" not in "".join(pieces[:-1])  # split UTF-8 is held back, not garbled


def test_stream_flushes_incomplete_utf8(llama3):
    first_byte_of_llama = llama3.encode("🦙", add_bos=False)[0]
    detok = StreamingDetokenizer(llama3)
    assert (detok.add(first_byte_of_llama), detok.flush()) == ("", "\ufffd")
