"""Speculative decoding in `mlxllama serve`: per request (prompt lookup, or off) and from the
server's drafter (--draft-model, --lookup), through a real server on a loopback port and the
official `openai` client. Greedy, every reply is the reply without speculation; the drafts show in
usage as OpenAI's Predicted Outputs count them."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

import mlxllama

from conftest import PACKAGE_DATA, REPO_FIXTURES, Server

MODEL = PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf"
LOOPING = REPO_FIXTURES / "qwen2-tiny-Q8_0.gguf"  # random weights that fall into loops: lookup drafts them well
QUESTIONS = ["What is the capital of Japan?", "What is 17 plus 25?", "My name is Zoe.", "What is the capital of Peru?"]


@pytest.fixture(scope="module")
def looping_server():
    s = Server("-m", str(LOOPING))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def looping():
    return mlxllama.load(LOOPING)


def complete(server, **fields) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", json=fields, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_request_asks_for_prompt_lookup_and_gets_the_plain_text(looping_server, looping):
    """Rows with lookup and rows without share the batch: each text is generate's alone, and only
    the lookup rows report drafts (accepted + rejected = drafted, some of each)."""
    prompts = ["Once upon a time", "The cat sat on", "Hello world", "A B C D E F"]

    def ask(i: int) -> dict:
        return complete(looping_server, prompt=prompts[i % 4], max_tokens=80,
                        **({"lookup": 2, "draft_tokens": 5} if i % 2 == 0 else {}))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        bodies = list(pool.map(ask, range(8)))
    for i, body in enumerate(bodies):
        assert body["choices"][0]["text"] == looping.generate(prompts[i % 4], 80).text, i
        details = body["usage"].get("completion_tokens_details")
        if i % 2:
            assert details is None
        else:
            assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] > 0, i


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_a_server_with_a_draft_model_drafts_every_request_unless_told_not_to(engine):
    """--draft-model (the model itself here: its drafts are its own picks, all kept on the CPU):
    replies, whole and streamed, are the plain replies; "speculative": false turns it off. An engine
    of its own process loads the draft model there."""
    server = Server("-m", str(MODEL), "--draft-model", str(MODEL), "--draft-tokens", "3", "--engine", engine)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        runtime = mlxllama.load(MODEL)
        for question in QUESTIONS:
            messages = [{"role": "user", "content": question}]
            plain = runtime.generate(runtime.tokenize(runtime.apply_chat_template(messages), special=True), 40)
            response = client.chat.completions.create(model="m", messages=messages, max_tokens=40)
            assert response.choices[0].message.content == plain.text
            details = response.usage.completion_tokens_details
            assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens == 0
            chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=40, stream=True,
                                                         stream_options={"include_usage": True}))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.text
            assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
        # The openai client's `prediction`: drafted from the predicted text instead of the draft model.
        predicted = client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                                   prediction={"type": "content",
                                                               "content": "The capital of Japan is Tokyo."})
        assert predicted.choices[0].message.content == "The capital of Japan is Tokyo."
        assert predicted.usage.completion_tokens_details.accepted_prediction_tokens >= 4  # of its 8 tokens
        off = client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                             extra_body={"speculative": False})
        assert off.choices[0].message.content == "The capital of Japan is Tokyo."
        assert off.usage.completion_tokens_details is None
    finally:
        server.stop()


def test_a_prediction_is_drafted_from_and_never_changes_the_text(looping_server, looping):
    """OpenAI's Predicted Outputs: the predicted text (tokenized alone, so only partly the reply's
    own ids here, whose random text does not tokenize back the same) is drafted from; a right
    prediction or a wrong one, the text is the plain text."""
    plain = looping.generate("The cat sat on", 80).text
    right = complete(looping_server, prompt="The cat sat on", max_tokens=80,
                     prediction={"type": "content", "content": plain})
    wrong = complete(looping_server, prompt="The cat sat on", max_tokens=80,
                     prediction={"type": "content", "content": [{"type": "text", "text": "Unrelated words. " * 5}]})
    assert right["choices"][0]["text"] == wrong["choices"][0]["text"] == plain
    assert right["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    assert wrong["usage"]["completion_tokens_details"]["rejected_prediction_tokens"] > 0


def test_a_constrained_request_with_lookup_matches_its_schema(looping_server, looping):
    from mlxllama.constraints import Constraint

    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 30}}, "required": ["a"]}
    body = complete(looping_server, prompt="Once upon a time", max_tokens=60, lookup=2,
                    response_format={"type": "json_object", "schema": schema})
    plain = looping.generate("Once upon a time", 60, constraint=Constraint.json_schema(schema))
    assert body["choices"][0]["text"] == plain.text


@pytest.mark.parametrize("fields, param, fragment", [
    ({"lookup": 0}, "lookup", "'lookup' must be an integer from 1 to 64"),
    ({"lookup": "2"}, "lookup", "'lookup' must be an integer from 1 to 64"),
    ({"speculative": "yes"}, "speculative", "'speculative' must be true or false"),
    ({"speculative": False, "lookup": 2}, "speculative", "excludes 'lookup'"),
    ({"prediction": "text"}, "prediction", "'prediction' must be {\"type\": \"content\""),
    ({"prediction": {"type": "content", "content": 3}}, "prediction.content", "must be a string or a list"),
    ({"draft_tokens": 3}, "draft_tokens", "'draft_tokens' needs 'lookup', or a server started with"),
])
def test_bad_speculation_fields_are_400_naming_the_field(looping_server, fields, param, fragment):
    response = httpx.post(f"{looping_server.url}/v1/completions", json={"prompt": "Hi", **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_a_ring_server_drafts_past_the_context_within_its_spare_slots():
    """--max-kv-size: the rows' rings keep DRAFT_ROOM slots for drafts, so a lookup request runs past
    the context and gets the ring's plain text; more drafts at a time than that is a 400."""
    from mlxllama.server import DRAFT_ROOM

    server = Server("-m", str(LOOPING), "-c", "256", "--max-kv-size", "64")
    try:
        plain, drafted = (complete(server, prompt="Once upon a time", max_tokens=300, **extra)
                          for extra in ({}, {"lookup": 2, "draft_tokens": 6}))
        assert drafted["choices"][0]["text"] == plain["choices"][0]["text"]
        assert drafted["usage"]["completion_tokens"] == 300
        assert drafted["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 100
        response = httpx.post(f"{server.url}/v1/completions",
                              json={"prompt": "Hi", "lookup": 2, "draft_tokens": DRAFT_ROOM + 1})
        assert response.status_code == 400 and response.json()["error"]["param"] == "draft_tokens"
        assert f"at most {DRAFT_ROOM} on a server with --max-kv-size" in response.json()["error"]["message"]
    finally:
        server.stop()
