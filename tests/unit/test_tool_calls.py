"""Reading tool calls back from replies in each family's format (recorded outputs, malformed ones
included), picking the format from the template, and the grammar of a required call."""

from __future__ import annotations

import json

import jsonschema
import pytest

import mlxllama
from mlxllama.tool_calls import Hermes, Llama3, Mistral, Tool, format_of, required_call, template_message

from conftest import REPO_FIXTURES, SHARED, skip_missing

WEATHER = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                               "unit": {"enum": ["celsius", "fahrenheit"]}},
                               "required": ["city", "unit"], "additionalProperties": False}, "Current weather")
TIME = Tool("get_time", {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                         "additionalProperties": False})


def calls(fmt, raw):
    content, found = fmt.parse(raw)
    return content, [(c.name, json.loads(c.arguments)) for c in found]


@pytest.mark.parametrize("raw, content, expected", [
    # Qwen 2.5 / Qwen3 / Hermes 2 Pro, as the models write them
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Oslo", "unit": "celsius"}}\n</tool_call>',
     "<think>\nThe user wants the weather.\n</think>\n\n", [("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>',
     "", [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Rome", "unit": "celsius"})]),
    # arguments as a JSON string (some fine-tunes), and an unclosed last block (cut by a stop)
    ('<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>', "",
     [("get_time", {"zone": "CET"})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}', "", [("get_time", {"zone": "CET"})]),
    # malformed: the reply is content, no calls
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": </tool_call>', None, []),
    ('<tool_call>\n{"arguments": {"zone": "UTC"}}\n</tool_call>', None, []),
    ('<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>', None, []),
    ("The weather in Paris is sunny.", None, []),
])
def test_hermes_calls(raw, content, expected):
    assert calls(Hermes(), raw) == (raw if content is None else content, expected)


@pytest.mark.parametrize("raw, expected", [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ('{"name": "get_time", "parameters": {"zone": "UTC"}}', [("get_time", {"zone": "UTC"})]),
    ('{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_time", "parameters": {"zone": "CET"}}',
     [("get_time", {"zone": "UTC"}), ("get_time", {"zone": "CET"})]),
    ('  {"type": "function", "name": "get_time", "parameters": {"zone": "UTC"}}', [("get_time", {"zone": "UTC"})]),
    ('{"name": "get_time", "parameters": {"zone": "UTC"}} and then some words', []),
    ('{"name": "get_time", "parameters": {"zone": ', []),
    ('{"answer": 42}', []),
    ("It is sunny in Paris.", []),
])
def test_llama3_calls(raw, expected):
    assert calls(Llama3(), raw) == (raw if not expected else "", expected)


@pytest.mark.parametrize("raw, expected", [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_time", "arguments": '
     '{"zone": "CET"}}]', [("get_time", {"zone": "UTC"}), ("get_time", {"zone": "CET"})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}',
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ('[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
     [("get_time", {"zone": "UTC"}), ("get_time", {"zone": "CET"})]),
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}', []),
    ('[TOOL_CALLS]get time[ARGS]{"zone": "UTC"}', []),
    ('[TOOL_CALLS]get_time{"zone": "UTC"}', []),
    ("Paris is sunny today.", []),
])
def test_mistral_calls(raw, expected):
    assert calls(Mistral(), raw) == (raw if not expected else "", expected)


def test_the_format_comes_from_the_template():
    assert format_of("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    templates = SHARED / "templates"
    if not templates.is_dir():
        skip_missing(templates)
    expected = {"Qwen-Qwen2.5-7B-Instruct": "hermes", "Qwen-Qwen3-0.6B": "hermes",
                "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
                "meta-llama-Llama-3.1-8B-Instruct": "llama3", "meta-llama-Llama-3.2-3B-Instruct": "llama3",
                "meta-llama-Llama-3.3-70B-Instruct": "llama3", "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
                "Mistral-Small-3.2-24B-Instruct-2506": "mistral", "google-gemma-2-2b-it": None}
    for name, fmt in expected.items():
        found = format_of((templates / f"{name}.jinja").read_text())
        assert (found.name if found else None) == fmt, name
    assert format_of((templates / "Mistral-Small-3.2-24B-Instruct-2506.jinja").read_text()).named_args
    assert not format_of((templates / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()).named_args


@pytest.mark.parametrize("model, fmt", [("qwen3-tiny-Q4_K_M.gguf", Hermes()), ("llama3-tiny-Q6_K.gguf", Llama3()),
                                        ("llama3-tiny-Q6_K.gguf", Mistral()),
                                        ("llama3-tiny-Q6_K.gguf", Mistral(named_args=True))])
@pytest.mark.parametrize("name", [None, "get_weather", "get_time"])
def test_a_required_call_is_one_call_that_reads_back_and_validates(model, fmt, name):
    """On random-weight models: whatever they write under the constraint is a call of the asked
    tool (or one of the tools), whose arguments match its schema."""
    rt = mlxllama.load(REPO_FIXTURES / model)
    result = rt.generate(rt.tokenize("Weather in Paris?"), 160, constraint=required_call(fmt, [WEATHER, TIME],
                                                                                            rt.tokenizer, name))
    assert result.finish_reason == "stop"
    content, found = fmt.parse(rt.tokenizer.decode_with_special_tokens(result.token_ids[:-1]))
    assert len(found) == 1 and content == "", result.text
    tool = {"get_weather": WEATHER, "get_time": TIME}[found[0].name]
    assert name in (None, tool.name)
    jsonschema.validate(json.loads(found[0].arguments), tool.parameters)


def test_a_required_call_of_an_unknown_tool_is_an_error():
    rt = mlxllama.load(REPO_FIXTURES / "qwen3-tiny-Q4_K_M.gguf")
    with pytest.raises(mlxllama.MlxLlamaError, match="no tool named 'nope'"):
        required_call(Hermes(), [WEATHER], rt.tokenizer, "nope")


def test_the_python_chat_api_calls_a_tool_and_renders_its_result_back():
    rt = mlxllama.load(REPO_FIXTURES / "qwen3-tiny-Q4_K_M.gguf")
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.parameters}} for t in (WEATHER, TIME)]
    messages = [{"role": "user", "content": "What time is it in UTC?"}]
    reply = rt.chat(messages, 128, tools=tools, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert reply.finish_reason == "tool_calls" and [c.name for c in reply.tool_calls] == ["get_time"]
    call = reply.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.as_openai()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    rendered = rt.apply_chat_template([template_message(m) for m in messages], tools=tools)
    assert f"<tool_call>\n{{\"name\": \"get_time\", \"arguments\": {call.arguments}}}\n</tool_call>" in rendered
    assert "<tool_response>\n12:00\n</tool_response>" in rendered
    answer = rt.chat(messages, 8, tools=tools)
    fed = rt.tokenizer.decode_with_special_tokens(answer.result.prompt_ids)
    assert fed.endswith("<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert call.arguments in fed
    with pytest.raises(mlxllama.MlxLlamaError, match="renders no tools"):
        mlxllama.load(REPO_FIXTURES / "mistral-tiny-Q4_K_M.gguf").chat(messages[:1], 4, tools=tools)
