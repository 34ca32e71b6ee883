"""Constrained generation (constraints.py): JSON Schema, any JSON object, regex and grammars, on a
SentencePiece vocabulary (chat-tiny) and two byte-level BPE ones (the qwen2 and llama3 fixtures)."""

from __future__ import annotations

import json
import re
from functools import cache

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

import mlxllama
from mlxllama import Constraint
from mlxllama.batching import Request, batch_generate
from mlxllama.constraints import Guide, InvalidConstraint, vocabulary
from mlxllama.sampling import SamplingParams

from conftest import PACKAGE_DATA, REPO_FIXTURES

MODELS = {
    "chat-tiny": PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf",  # SentencePiece with byte fallback; trained
    "qwen2": REPO_FIXTURES / "qwen2-tiny-Q8_0.gguf",  # byte-level BPE; random weights
    "llama3": REPO_FIXTURES / "llama3-tiny-Q6_K.gguf",  # byte-level BPE; random weights
}
SCHEMAS = json.loads((REPO_FIXTURES / "structured" / "schemas.json").read_text())
PROMPTS = ["Describe a person as JSON.", "What is the capital of Japan?"]
SAMPLED = SamplingParams(temperature=0.8, seed=7)
CAPITAL = r"The capital of [A-Z][a-z]+ is [A-Z][a-z]+\."


@cache
def runtime(name: str):
    return mlxllama.load(MODELS[name])


def chat_ids(rt, text: str) -> list[int]:
    return rt.tokenize(rt.apply_chat_template([{"role": "user", "content": text}]), special=True)


@pytest.mark.parametrize("name", MODELS)
def test_the_engine_sees_each_token_as_the_bytes_it_decodes_to(name):
    tokenizer = runtime(name).tokenizer
    engine_vocab = vocabulary(tokenizer)
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.token_bytes(i)
        if tokenizer.is_control(i) or not piece or piece.startswith(b"\xff"):
            # (0xff, llguidance's mark of a special token, is never part of UTF-8 text: the byte
            # piece <0xFF> can never be allowed, rightly)
            assert engine_vocab.is_special_token(i), i
        else:
            assert engine_vocab.decode_bytes([i]) == piece, i
    assert set(engine_vocab.eos_tokens) == set(tokenizer.stop_ids)


@pytest.mark.parametrize("name", MODELS)
def test_a_mask_allows_exactly_the_tokens_that_keep_the_text_in_the_language(name):
    # Two digits then a full stop: the first token may be a digit or two, or a digit and the stop;
    # checked against the vocabulary's bytes directly. chat-tiny's byte pieces (<0x35>…) count too.
    tokenizer = runtime(name).tokenizer
    allowed = Guide(Constraint.regex(r"[0-9]{2}\."), tokenizer).allowed_ids()
    language = re.compile(rb"[0-9]{1,2}|[0-9]{2}\.")
    expected = np.array([not tokenizer.is_control(i) and bool(language.fullmatch(tokenizer.token_bytes(i)))
                         for i in range(tokenizer.vocab_size)])
    assert expected.sum() >= 10
    np.testing.assert_array_equal(allowed, expected)
    if name == "chat-tiny":
        assert allowed[tokenizer.encode_continuation("5")].all() and allowed[tokenizer._token_to_id["<0x35>"]]


def test_encode_continuation_adds_no_space_prefix_and_no_bos():
    tokenizer = runtime("chat-tiny").tokenizer
    assert tokenizer.decode(tokenizer.encode_continuation('{"a": 1}')) == '{"a": 1}'
    assert tokenizer.encode("{", add_bos=False) != tokenizer.encode_continuation("{")


def near_tie(rt) -> float:
    """How far apart two logits may be and still count as a tie between two computations of them:
    float32 on the CPU; float16 on a GPU (CUDA kernels for decode steps, MLX's matmuls for a
    full pass), where test_llama_parity.py's bar for llama.cpp's float16 logits serves."""
    return 1e-3 if rt.model.compute_dtype == mx.float32 else 0.08


def replay(rt, constraint: Constraint, prompt: list[int], ids: list[int], greedy: bool) -> None:
    """Every generated token was allowed where it came; greedy ones were the likeliest allowed.

    The logits come from one fresh pass over prompt + output, a different computation from the
    cached decode steps, so "likeliest" holds up to near-ties: the chosen token's logit is within
    near_tie() of the best allowed logit.
    """
    guide = Guide(constraint, rt.tokenizer)
    logits = rt.logits(prompt + ids)[len(prompt) - 1:] if greedy else None
    for n, token in enumerate(ids):
        allowed = guide.allowed_ids()
        assert allowed[token], f"token {n} ({token}) was not allowed"
        if greedy:
            row = logits[n][: len(allowed)]
            assert row[token] >= row[allowed].max() - near_tie(rt), f"token {n} was not the likeliest allowed"
        guide.accept(token)


def assert_same_up_to_a_near_tie(rt, constraint, prompt: list[int], ids: list[int], other: list[int]) -> None:
    """Two greedy outputs under one constraint are equal, or part where the two likeliest allowed
    tokens are a near-tie (on the CPU, batched and lone rows compute bit-identical logits; MLX's
    CUDA backend rounds a batch's rows differently from one sequence's)."""
    common = next((i for i, (a, b) in enumerate(zip(ids, other)) if a != b), None)
    if common is None:
        assert len(ids) == len(other) or rt.model.compute_dtype != mx.float32
        return
    assert rt.model.compute_dtype != mx.float32, f"they part at token {common} on the CPU"
    guide = Guide(constraint, rt.tokenizer) if constraint else None
    for token in ids[:common]:
        if guide:
            guide.accept(token)
    row = rt.logits(prompt + ids[:common])[-1][: rt.tokenizer.vocab_size]
    allowed = guide.allowed_ids() if guide else np.ones(len(row), bool)
    assert abs(row[ids[common]] - row[other[common]]) < near_tie(rt) and allowed[other[common]]


@pytest.mark.parametrize("name", MODELS)
def test_json_schemas_give_output_that_parses_and_validates(name):
    """24 schemas x 2 prompts, greedy and sampled, batched 8 at a time (each row its own constraint):
    at least 90% end with `stop` within 256 tokens and every one of those validates."""
    rt = runtime(name)
    cases = [(schema_name, prompt, params) for schema_name in SCHEMAS for prompt in PROMPTS
             for params in (SamplingParams(), SAMPLED)]
    requests = [Request(chat_ids(rt, prompt), 256, params, constraint=Constraint.json_schema(SCHEMAS[schema_name]))
                for schema_name, prompt, params in cases]
    results = batch_generate(rt, requests, batch_size=8)
    stopped = [(case, r) for case, r in zip(cases, results) if r.finish_reason == "stop"]
    assert len(stopped) >= 0.9 * len(cases), f"{len(stopped)} of {len(cases)} stopped"
    for (schema_name, _, _), result in stopped:
        jsonschema.validate(json.loads(result.text), SCHEMAS[schema_name])
        assert result.token_ids[-1] in rt.tokenizer.stop_ids
    for (schema_name, prompt, params), request, result in list(zip(cases, requests, results))[::5]:
        replay(rt, request.constraint, list(request.ids), result.token_ids, params.temperature == 0)


@pytest.mark.parametrize("name", MODELS)
def test_a_batch_row_generates_what_the_constraint_generates_alone(name):
    rt = runtime(name)
    prompt = chat_ids(rt, PROMPTS[0])
    constraints = [Constraint.json_schema(SCHEMAS["person"]), Constraint.json_object(), None,
                   Constraint.regex(r"[a-z ]{1,20}\."), Constraint.json_schema(SCHEMAS["todo_list"])]
    batched = batch_generate(rt, [Request(prompt, 40, constraint=c) for c in constraints], batch_size=4)
    for constraint, result in zip(constraints, batched):
        alone = rt.generate(prompt, 40, constraint=constraint).token_ids
        assert_same_up_to_a_near_tie(rt, constraint, prompt, result.token_ids, alone)


def test_where_the_free_output_already_matches_the_constrained_output_is_identical():
    rt = runtime("chat-tiny")
    prompt = chat_ids(rt, "What is the capital of Japan?")
    free = rt.generate(prompt, 64)
    assert free.text == "The capital of Japan is Tokyo."
    grammar = 'root ::= "The capital of " [A-Z] [a-z]+ " is " [A-Z] [a-z]+ "."'
    for constraint in (Constraint.regex(CAPITAL), Constraint.grammar(grammar),
                       Constraint.grammar('start: "The capital of " /[A-Z][a-z]+/ " is " /[A-Z][a-z]+/ "."')):
        assert rt.generate(prompt, 64, constraint=constraint).token_ids == free.token_ids


def test_a_constraint_changes_what_the_free_output_would_break():
    rt = runtime("chat-tiny")
    prompt = chat_ids(rt, "What is the capital of Japan?")
    result = rt.generate(prompt, 64, constraint=Constraint.regex(r"(Tokyo|Kyoto|Osaka)"))
    assert result.text in ("Tokyo", "Kyoto", "Osaka") and result.finish_reason == "stop"
    enum = rt.generate(prompt, 64, constraint=Constraint.json_schema({"enum": ["yes", "no"]}))
    assert json.loads(enum.text) in ("yes", "no")


def test_an_output_cut_by_max_tokens_says_length():
    rt = runtime("chat-tiny")
    result = rt.generate(chat_ids(rt, PROMPTS[0]), 5, constraint=Constraint.json_schema(SCHEMAS["person"]))
    assert result.finish_reason == "length" and len(result.token_ids) == 5
    assert result.text.startswith("{")


def test_the_sampler_masks_before_temperature_and_top_k():
    from mlxllama.sampling import make_sampler

    logits = mx.array([5.0, 4.0, 3.0, 2.0, 1.0])
    allowed = mx.array([False, False, True, True, False])
    assert make_sampler(SamplingParams())(logits, [], allowed=allowed).item() == 2
    # top-k 1 after the mask keeps the likeliest allowed token, never a disallowed one
    sampler = make_sampler(SamplingParams(temperature=1.0, top_k=1, seed=0))
    assert {sampler(logits, [], allowed=allowed).item() for _ in range(20)} == {2}


@pytest.mark.parametrize("constraint,message", [
    (lambda: Constraint.json_schema('{"type": "object",'), r"^JSON schema: not valid JSON \(.*line 1 column 19\)$"),
    (lambda: Constraint.json_schema('[1, 2]'), r"^JSON schema: expected a JSON object$"),
    (lambda: Constraint.json_schema({"type": "strin"}), r"^JSON schema: .*strin"),
    # a keyword the engine cannot enforce is refused rather than ignored (unknown ones are ignored, as the spec says)
    (lambda: Constraint.json_schema({"type": "array", "uniqueItems": True}), r"^JSON schema: Unimplemented keys: .*uniqueItems"),
    (lambda: Constraint.json_schema({"$ref": "#/$defs/missing"}), r"^JSON schema: .*/\$defs/missing"),
    (lambda: Constraint.regex("(ab"), r"^regex: .*"),
    (lambda: Constraint.grammar('root ::= "a" undefined_rule'), r"^grammar: .*undefined_rule"),
    (lambda: Constraint.grammar("root ::= ("), r"^grammar: .*"),
    (lambda: Constraint.of("json_object", "yes"), r"^json_object must be true$"),
    (lambda: Constraint.of("xml", "x"), r"^unknown constraint 'xml'"),
])
def test_a_bad_constraint_is_a_one_line_error(constraint, message):
    with pytest.raises(InvalidConstraint) as info:
        constraint().check(runtime("chat-tiny").tokenizer)
    assert "\n" not in str(info.value)
    assert re.search(message, str(info.value)), str(info.value)
