"""`mlxllama serve` with response_format and tools, through the `openai` client against a real
server process: JSON and JSON Schema replies, and tool calls in the Hermes/Qwen (qwen3 fixture)
and Llama 3.x (llama3 fixture) formats, whole and streamed, with a full round trip."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

import mlxllama
from mlxllama import Constraint

from conftest import PACKAGE_DATA, REPO_FIXTURES
from test_server import Server

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def start(model) -> tuple[Server, openai.OpenAI]:
    server = Server("-m", str(model))
    return server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tiny():
    server, client = start(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf")
    yield server, client
    server.stop()


@pytest.fixture(scope="module", params=["qwen3-tiny-Q4_K_M.gguf", "llama3-tiny-Q6_K.gguf"])
def tool_server(request):
    server, client = start(REPO_FIXTURES / request.param)
    yield server, client, mlxllama.load(REPO_FIXTURES / request.param)
    server.stop()


def test_json_schema_response_format_in_chat_and_completions(tiny):
    server, client = tiny
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Describe a person."}],
                                          response_format=response_format)
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    runtime = mlxllama.load(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf")
    prompt = runtime.tokenize(runtime.apply_chat_template([{"role": "user", "content": "Describe a person."}]),
                              special=True)
    assert chat.choices[0].message.content == runtime.generate(
        prompt, 256, constraint=Constraint.json_schema(PERSON)).text
    completion = client.completions.create(model="m", prompt="A person:", max_tokens=64,
                                           extra_body={"response_format": response_format})
    if completion.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(completion.choices[0].text), PERSON)
    assert completion.choices[0].text.startswith("{")


def test_json_object_streamed_is_the_whole_reply(tiny):
    server, client = tiny
    kwargs = dict(model="m", messages=[{"role": "user", "content": "Anything"}], max_tokens=48,
                  response_format={"type": "json_object"})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert whole.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": {"type": "xml"}}, "response_format", "'response_format' must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}}},
     "response_format", "Unimplemented keys"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format", "'schema' object"),
    ({"tools": [WEATHER]}, "tools", "renders no tools"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice", "tool_choice must be"),
])
def test_bad_structured_requests_are_400_naming_the_field(tiny, body, param, fragment):
    server, _ = tiny
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_a_required_tool_call_round_trip(tool_server):
    server, client, runtime = tool_server
    first = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           max_tokens=128)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"
    # The call and its result go back through the template; the reply is generated from there.
    messages = [*ASK, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER, TIME], tool_choice="none",
                                            max_tokens=8, extra_body={"return_prompt": True})
    assert second.choices[0].finish_reason in ("stop", "length")
    fed = second.model_extra["prompt"]["text"]
    # (Llama 3.1's template writes a tool result through tojson, quotes escaped; Qwen3's as it is)
    assert ('{"temperature": 21}' in fed or '{\\"temperature\\": 21}' in fed) and call.function.name in fed


def test_a_named_tool_choice_calls_that_tool_and_streams_the_same_call(tool_server):
    server, client, _ = tool_server
    kwargs = dict(model="m", messages=ASK, tools=[WEATHER, TIME], max_tokens=128,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert [c.function.name for c in whole.message.tool_calls] == ["get_time"]
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_time", json.loads(whole.message.tool_calls[0].function.arguments))]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_streams_plain_text_as_the_whole_reply_has_it(tool_server):
    server, client, _ = tool_server
    kwargs = dict(model="m", messages=ASK, tools=[WEATHER], max_tokens=24)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    if whole.finish_reason == "tool_calls":
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    else:
        assert streamed == whole.message.content and whole.message.tool_calls is None


def test_an_unknown_named_tool_is_400(tool_server):
    server, _, _ = tool_server
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
