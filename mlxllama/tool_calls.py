"""Tool calling: the formats model families write calls in, read back into OpenAI's `tool_calls`,
and the grammar that holds a reply to a call when the request requires one.

The format is the chat template's: a template that writes Hermes/Qwen `<tool_call>` blocks
expects the model to answer in them, Llama 3.x's asks for a JSON object with "name" and
"parameters" (after `<|python_tag|>` or bare), Mistral's for `[TOOL_CALLS]` followed by a JSON list
of calls or, in its newer templates, by `name[ARGS]{arguments}`. Output is read from the generated
ids with control tokens spelled out, since `[TOOL_CALLS]` and `<|python_tag|>` are control tokens
that plain decoding drops.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from .constraints import JSON_WHITESPACE, Constraint
from .errors import MlxLlamaError
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Tool:
    """A function the model may call: OpenAI's {"type": "function", "function": {...}}."""

    name: str
    parameters: dict
    description: str = ""

    def as_openai(self) -> dict:
        """The shape templates are given (transformers passes OpenAI's tools through as they are)."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's clients parse it)
    id: str = ""

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolFormat:
    """How one family writes calls. `marker` is the text that starts a call in the raw output."""

    name = ""
    marker = ""

    def parse(self, raw: str) -> tuple[str, list[ToolCall]]:
        """(the text before the calls, the calls) of a reply; no calls if it holds none that parse."""
        start = raw.find(self.marker)
        if start < 0:
            return raw, []
        calls = self.read_calls(raw[start + len(self.marker):])
        return (raw[:start], calls) if calls else (raw, [])

    def read_calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError

    def grammar(self, calls_schema: dict, tokenizer: Tokenizer) -> str:
        """A Lark grammar (llguidance's) for a reply that is one call matching calls_schema."""
        raise NotImplementedError

    def may_start_call(self, raw: str) -> bool:
        """Whether a streamed reply's raw text so far holds, or ends in the start of, a call."""
        return self.marker in raw or any(raw.endswith(self.marker[:n]) for n in range(1, len(self.marker)))


def token_or_text(tokenizer: Tokenizer, text: str) -> str:
    """A grammar literal for `text`: the control token of that spelling if the vocabulary has one
    (it cannot be written as text), else the quoted text."""
    token = tokenizer.control_id(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def call_object(name_key: str, arguments_key: str, tool: Tool) -> dict:
    return {"type": "object", "properties": {name_key: {"const": tool.name}, arguments_key: tool.parameters},
            "required": [name_key, arguments_key], "additionalProperties": False}


def embedded(schema: dict) -> str:
    """A JSON Schema as llguidance's %json grammar item, with JSON whitespace bounded as everywhere."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}})


def read_object(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of text (after whitespace) and where it ends, or None."""
    stripped = len(text) - len(text.lstrip())
    try:
        value, end = json.JSONDecoder().raw_decode(text, stripped)
    except ValueError:
        return None
    return value, end


def to_call(value: Any, arguments_keys: Sequence[str]) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[k] for k in arguments_keys if k in value), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False), call_id())


class Hermes(ToolFormat):
    """Hermes and Qwen: each call a JSON object {"name", "arguments"} inside <tool_call>…</tool_call>."""

    name = "hermes"
    marker = "<tool_call>"
    end = "</tool_call>"

    def read_calls(self, text: str) -> list[ToolCall]:
        calls = []
        for block in (self.marker + text).split(self.marker)[1:]:
            body, closed, _ = block.partition(self.end)
            found = read_object(body)
            call = to_call(found[0], ("arguments", "parameters")) if found else None
            if call is None or not closed and body.strip()[found[1]:].strip():
                return []
            calls.append(call)
        return calls

    def grammar(self, calls_schema: dict, tokenizer: Tokenizer) -> str:
        return (f"start: {token_or_text(tokenizer, self.marker)} \"\\n\" {embedded(calls_schema)} \"\\n\" "
                f"{token_or_text(tokenizer, self.end)}")


class Llama3(ToolFormat):
    """Llama 3.1-3.3's JSON tool calls: {"name", "parameters"}, after <|python_tag|> or as the
    whole reply; several may be separated by ';'."""

    name = "llama3"
    marker = "<|python_tag|>"

    def parse(self, raw: str) -> tuple[str, list[ToolCall]]:
        body = raw.split(self.marker, 1)[1] if self.marker in raw else raw
        if not body.lstrip().startswith("{"):
            return raw, []
        calls = self.read_calls(body)
        return ("", calls) if calls else (raw, [])

    def read_calls(self, text: str) -> list[ToolCall]:
        calls, rest = [], text
        while rest.strip():
            found = read_object(rest)
            call = to_call(found[0], ("parameters", "arguments")) if found else None
            if call is None:
                return []
            calls.append(call)
            rest = rest[found[1]:].lstrip().removeprefix(";")
        return calls

    def grammar(self, calls_schema: dict, tokenizer: Tokenizer) -> str:
        return f"start: {embedded(calls_schema)}"

    def may_start_call(self, raw: str) -> bool:
        return self.marker in raw or raw.lstrip()[:1] in ("{", "")


class Mistral(ToolFormat):
    """Mistral: [TOOL_CALLS] then a JSON list of {"name", "arguments"} (v3), or then
    name[ARGS]{arguments}, once per call (`named_args`: the templates of Mistral Small 3.2,
    Devstral, Ministral). Either is read back whichever the template writes."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    args = "[ARGS]"

    def __init__(self, named_args: bool = False):
        self.named_args = named_args

    def read_calls(self, text: str) -> list[ToolCall]:
        if text.lstrip().startswith("["):
            found = read_object(text)
            if found is None or not isinstance(found[0], list) or text[found[1]:].strip():
                return []
            calls = [to_call(value, ("arguments", "parameters")) for value in found[0]]
            return calls if calls and all(calls) else []
        calls = []
        for part in text.split(self.marker):
            name, sep, arguments = part.partition(self.args)
            found = read_object(arguments) if sep else None
            if found is None or not re.fullmatch(r"[\w.-]+", name.strip()) or arguments[found[1]:].strip():
                return []
            call = to_call({"name": name.strip(), "arguments": found[0]}, ("arguments",))
            if call is None:
                return []
            calls.append(call)
        return calls

    def grammar(self, calls_schema: dict, tokenizer: Tokenizer) -> str:
        marker = token_or_text(tokenizer, self.marker)
        if not self.named_args:
            return f"start: {marker} \"[\" {embedded(calls_schema)} \"]\""
        calls = [(o["properties"]["name"]["const"], o["properties"]["arguments"])
                 for o in calls_schema.get("anyOf", [calls_schema])]
        alternatives = " | ".join(f"{json.dumps(name)} {token_or_text(tokenizer, self.args)} {embedded(arguments)}"
                                  for name, arguments in calls)
        return f"start: {marker} ({alternatives})"



def format_of(template_text: str | None) -> ToolFormat | None:
    """The call format a chat template asks for, from what it writes; None if it renders no tools."""
    if not template_text or "tools" not in template_text:
        return None
    if Mistral.marker in template_text:
        return Mistral(named_args=Mistral.args in template_text)
    if Hermes.marker in template_text:
        return Hermes()
    if "<|start_header_id|>" in template_text or Llama3.marker in template_text:
        return Llama3()
    return None


def required_call(fmt: ToolFormat, tools: Sequence[Tool], tokenizer: Tokenizer, name: str | None = None) -> Constraint:
    """A constraint for a reply that is exactly one call: of the named tool, or of any of `tools`,
    with arguments that match that tool's parameters schema."""
    chosen = [t for t in tools if name is None or t.name == name]
    if not chosen:
        raise MlxLlamaError(f"no tool named {name!r} among the request's tools")
    keys = ("name", "parameters") if fmt.name == "llama3" else ("name", "arguments")
    objects = [call_object(*keys, tool) for tool in chosen]
    schema = objects[0] if len(objects) == 1 else {"anyOf": objects}
    return Constraint.grammar(fmt.grammar(schema, tokenizer))


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools: what the template is given, the format the reply is read in, and
    what a required call constrains it to. `choice` is "auto", "required" or one tool's name."""

    tools: tuple[Tool, ...]
    format: ToolFormat
    choice: str = "auto"

    def template_variables(self) -> dict:
        return {"tools": [tool.as_openai() for tool in self.tools]}

    def constraint(self, tokenizer: Tokenizer) -> Constraint | None:
        if self.choice == "auto":
            return None
        return required_call(self.format, self.tools, tokenizer, None if self.choice == "required" else self.choice)

    def read_reply(self, tokenizer: Tokenizer, ids: Sequence[int]) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a finished reply's ids (a final stop token left out)."""
        if ids and ids[-1] in tokenizer.stop_ids:
            ids = ids[:-1]
        return self.format.parse(tokenizer.decode_with_special_tokens(ids))


def tool_use(template_text: str | None, template_label: str, tools: Sequence[Tool],
             choice: str = "auto") -> ToolUse | None:
    """The ToolUse of a request, or None when it has no tools or `choice` is "none"; a template
    that renders no tools, or whose call format is not one we read, is an error."""
    if not tools or choice == "none":
        return None
    fmt = format_of(template_text)
    if fmt is None:
        raise MlxLlamaError(f"the chat template ({template_label}) renders no tools in a format this runtime reads"
                            " (Hermes/Qwen <tool_call>, Llama 3.x JSON, Mistral [TOOL_CALLS])")
    if choice not in ("auto", "required") and choice not in {t.name for t in tools}:
        raise MlxLlamaError(f"no tool named {choice!r} among the request's tools")
    return ToolUse(tuple(tools), fmt, choice)


def template_message(message: dict) -> dict:
    """A chat message as templates expect it: a call's arguments as an object, not OpenAI's JSON
    text, and the null content of a message that only calls tools as "" (as llama.cpp's server
    makes it: templates such as Qwen3's test `in message.content`)."""
    if message.get("content", "") is None:
        message = {**message, "content": ""}
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = dict(call.get("function", {}))
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass  # left as the text it is; the template shows what the client sent
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}


def read_tools(tools: Any) -> list[Tool]:
    """OpenAI's `tools` list, checked; a problem raises MlxLlamaError naming the entry."""
    if not isinstance(tools, list):
        raise MlxLlamaError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    out = []
    for i, entry in enumerate(tools):
        function = entry.get("function") if isinstance(entry, dict) and entry.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", function["name"]):
            raise MlxLlamaError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": NAME, ...}}}}"
                                " with a name of letters, digits, '_', '.' or '-'")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise MlxLlamaError(f"tools[{i}].function.parameters must be a JSON Schema object")
        description = function.get("description", "")
        if not isinstance(description, str):
            raise MlxLlamaError(f"tools[{i}].function.description must be a string")
        out.append(Tool(function["name"], parameters, description))
    if len({t.name for t in out}) < len(out):
        raise MlxLlamaError("tools: two tools have the same name")
    return out


def read_tool_choice(choice: Any) -> str:
    """OpenAI's `tool_choice` as "none", "auto", "required" or the name of the tool to call."""
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        return choice["function"]["name"]
    raise MlxLlamaError("tool_choice must be \"none\", \"auto\", \"required\" or "
                        "{\"type\": \"function\", \"function\": {\"name\": NAME}}")


class ToolCallStream:
    """A streamed reply that may hold calls: its text goes out while the reply so far cannot be a
    call, and is held back from where one may start; finish() reads the calls."""

    def __init__(self, use: ToolUse, tokenizer: Tokenizer):
        self.use, self.tokenizer = use, tokenizer
        self.raw = ""  # the ids so far, control tokens spelled out: where the markers show
        self.held = ""
        self.sent = ""

    def add(self, piece: str, ids: Sequence[int]) -> str:
        """The text to send now, given the next text piece and the ids generated since the last."""
        self.raw += self.tokenizer.decode_with_special_tokens([i for i in ids if i not in self.tokenizer.stop_ids])
        self.held += piece
        if self.use.format.may_start_call(self.raw):
            return ""
        out, self.held = self.held, ""
        self.sent += out
        return out

    def finish(self, text: str, ids: Sequence[int]) -> tuple[str, list[ToolCall]]:
        """(the text still to send, the calls) once the reply is complete (`text` and `ids` whole)."""
        content, calls = self.use.read_reply(self.tokenizer, ids)
        if not calls:
            return text[len(self.sent):], []
        return (content[len(self.sent):] if content.startswith(self.sent) else ""), calls
