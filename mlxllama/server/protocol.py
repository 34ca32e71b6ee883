"""OpenAI's request fields, checked and turned into generation settings; its error body.

Every problem with a request is an ApiError naming the field, answered as HTTP 400 with the body
`{"error": {"message", "type", "param", "code"}}` that OpenAI's clients parse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..constraints import Constraint, InvalidConstraint
from ..errors import MlxLlamaError
from ..sampling import InvalidSampling, SamplingParams
from ..tool_calls import Tool, read_tool_choice, read_tools, template_message

# Fields a client may send that change nothing here (OpenAI's bookkeeping).
IGNORED = {"model", "user", "stream_options", "metadata", "store", "service_tier"}
# Fields of OpenAI's API this server does not implement yet: refused rather than silently ignored.
NOT_YET = {"suffix", "best_of", "functions", "function_call", "parallel_tool_calls"}
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n", "seed": "seed",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Settings:
    """What one request asks for, besides its prompt."""

    max_tokens: int
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    template: str | None  # chat_template: a built-in name, "none", or None for the server's
    template_kwargs: dict
    return_prompt: bool
    logprobs: int | None = None  # log-probabilities of the generated tokens, with this many alternatives
    echo: bool = False  # /v1/completions: the prompt back in the text, and its tokens' log-probabilities
    constraint: Constraint | None = None  # response_format's JSON object or JSON Schema
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"  # "none", "auto", "required" or the name of the tool to call
    # Speculative decoding (extensions): off for this request, prompt lookup's n-gram length, drafts a check.
    speculative: bool = True
    lookup: int | None = None
    draft_tokens: int | None = None
    prediction: str | None = None  # OpenAI's Predicted Outputs: text the reply is expected to follow


def read_settings(body: dict, defaults: SamplingParams, default_max_tokens: int, known: set[str]) -> Settings:
    """The request's settings over the server's defaults; `known` are the endpoint's own fields."""
    for name in body:
        if name in NOT_YET:
            raise ApiError(f"'{name}' is not supported by this server yet", name)
        if name not in known | IGNORED | set(SAMPLING_FIELDS) | {"logprobs", "top_logprobs", "echo"} | {
                "max_tokens", "max_completion_tokens", "stop", "stream", "n", "chat_template", "logit_bias",
                "chat_template_kwargs", "return_prompt", "response_format"} | set(SPECULATION_FIELDS):
            raise ApiError(f"unknown field '{name}'", name)
    if body.get("n", 1) != 1:
        raise ApiError("only n = 1 is supported", "n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if not _integer(max_tokens) or max_tokens < 0:
        raise ApiError(f"'{field}' must be a non-negative integer", field)
    overrides = {}
    for name, setting in SAMPLING_FIELDS.items():
        if name in body:
            value = body[name]
            if value is not None and not (_integer(value) or isinstance(value, float) and math.isfinite(value)):
                raise ApiError(f"'{name}' must be a number", name)
            overrides[setting] = value
    if "logit_bias" in body:
        overrides["logit_bias"] = read_logit_bias(body["logit_bias"])
    try:
        params = defaults.with_overrides(**overrides)
    except InvalidSampling as e:
        raise ApiError(f"'{e.name}' must be {e.must}, got {e.value!r}", e.name) from None
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
        raise ApiError("'stop' must be a string or a list of at most 16 strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError("'stream_options' must be an object", "stream_options")
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ApiError("'chat_template' must be a built-in template name or \"none\"", "chat_template")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    return_prompt = body.get("return_prompt", False)
    if not isinstance(return_prompt, bool):
        raise ApiError("'return_prompt' must be true or false", "return_prompt")
    tools, tool_choice = read_tool_fields(body) if "tools" in known else ((), "auto")
    return Settings(max_tokens, params, tuple(stop), stream, bool(options.get("include_usage")), template, kwargs,
                    return_prompt, *read_logprobs(body, chat="messages" in known),
                    constraint=read_response_format(body.get("response_format")), tools=tools, tool_choice=tool_choice,
                    **read_speculation(body))


SPECULATION_FIELDS = ("speculative", "lookup", "draft_tokens", "prediction")


def read_speculation(body: dict) -> dict:
    """The speculative decoding fields: the extensions "speculative": false (none for this
    request), "lookup": n (prompt lookup over n-grams, whatever the server drafts with),
    "draft_tokens": k; and OpenAI's "prediction" (lookup in the predicted text first)."""
    speculative = body.get("speculative", True)
    if not isinstance(speculative, bool):
        raise ApiError("'speculative' must be true or false", "speculative")
    for name in ("lookup", "draft_tokens"):
        value = body.get(name)
        if value is not None and (not _integer(value) or not 1 <= value <= 64):
            raise ApiError(f"'{name}' must be an integer from 1 to 64", name)
    prediction = read_prediction(body.get("prediction"))
    if not speculative and (body.get("lookup") is not None or body.get("draft_tokens") is not None or prediction):
        raise ApiError("'speculative': false excludes 'lookup', 'draft_tokens' and 'prediction'", "speculative")
    return {"speculative": speculative, "lookup": body.get("lookup"), "draft_tokens": body.get("draft_tokens"),
            "prediction": prediction}


def read_prediction(value: Any) -> str | None:
    """OpenAI's `prediction`: {"type": "content", "content": text or text parts}, the text."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "content" or "content" not in value:
        raise ApiError("'prediction' must be {\"type\": \"content\", \"content\": ...}", "prediction")
    return read_content(value["content"], "prediction.content")


def read_response_format(value: Any) -> Constraint | None:
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"}, or {"type":
    "json_schema", "json_schema": {"name", "schema", "strict"}} (llama-server's {"type":
    "json_object", "schema": {...}} too). The schema is compiled when the request is answered."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    try:
        if kind == "json_object":
            return Constraint.json_schema(value["schema"]) if "schema" in value else Constraint.json_object()
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ApiError("'response_format.json_schema' must be an object with a 'schema' object",
                               "response_format")
            return Constraint.json_schema(spec.get("schema", {}))
    except InvalidConstraint as e:
        raise ApiError(f"response_format: {e}", "response_format") from None
    raise ApiError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                   "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                   "response_format")


def read_tool_fields(body: dict) -> tuple[tuple[Tool, ...], str]:
    try:
        tools = tuple(read_tools(body["tools"])) if body.get("tools") is not None else ()
    except MlxLlamaError as e:
        raise ApiError(str(e), "tools") from None
    try:
        choice = read_tool_choice(body.get("tool_choice"))
    except MlxLlamaError as e:
        raise ApiError(str(e), "tool_choice") from None
    if choice not in ("none", "auto") and not tools:
        raise ApiError(f"'tool_choice' {choice!r} needs 'tools'", "tool_choice")
    return tools, choice


def read_logprobs(body: dict, chat: bool) -> tuple[int | None, bool]:
    """(alternatives a token's log-probability comes with, or None for no log-probabilities; echo),
    from chat's `logprobs: true` + `top_logprobs: k` or completions' `logprobs: k` + `echo`."""
    logprobs, echo = body.get("logprobs"), body.get("echo", False)
    if chat:
        top = body.get("top_logprobs")
        if logprobs not in (None, True, False):
            raise ApiError("'logprobs' must be true or false", "logprobs")
        if top is not None and (not _integer(top) or not 0 <= top <= 20 or not logprobs):
            raise ApiError("'top_logprobs' must be an integer from 0 to 20, with 'logprobs': true", "top_logprobs")
        if "echo" in body:
            raise ApiError("'echo' is a field of /v1/completions", "echo")
        return (top or 0) if logprobs else None, False
    if "echo" in body and not isinstance(echo, bool):
        raise ApiError("'echo' must be true or false", "echo")
    if logprobs is not None and (not _integer(logprobs) or not 0 <= logprobs <= 5):
        raise ApiError("'logprobs' must be an integer from 0 to 5", "logprobs")
    return logprobs, echo


def read_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ApiError("'logit_bias' must be an object of token ids to numbers", "logit_bias")
    try:
        return tuple((int(token), float(bias)) for token, bias in value.items())
    except (TypeError, ValueError):
        raise ApiError("'logit_bias' must map token ids to numbers", "logit_bias") from None


def read_messages(body: dict) -> list[dict[str, Any]]:
    """The chat messages, each content as text (a string, or a list of text parts joined), with an
    assistant's tool_calls and a tool result's tool_call_id and name kept for the template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
        calls = message.get("tool_calls")
        content = message.get("content")
        if calls is not None:
            if message["role"] != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls):
                raise ApiError(f"messages[{i}].tool_calls must be an assistant's list of "
                               "{\"function\": {\"name\", \"arguments\"}} objects", f"messages[{i}].tool_calls")
        read = {"role": message["role"],
                "content": "" if content is None and calls else read_content(content, f"messages[{i}].content")}
        if calls:
            read["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                read[key] = message[key]
        out.append(template_message(read))
    return out


def read_content(content: Any, field: str) -> str:
    """A message's text: a string, or a list of text parts (OpenAI's and Anthropic's blocks) joined."""
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise ApiError(f"{field}: only text parts are supported", field)
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise ApiError(f"{field} must be a string or a list of text parts", field)
    return content


ANTHROPIC_FIELDS = {"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k",
                    "stream", "metadata"}


def read_anthropic(body: dict) -> tuple[list[dict[str, Any]], dict]:
    """Anthropic's Messages request as the chat messages (its system first) and the OpenAI fields
    its own ones mean, for read_settings."""
    for name in body:
        if name not in ANTHROPIC_FIELDS:
            raise ApiError(f"'{name}' is not supported by this server", name)
    if not _integer(body.get("max_tokens")) or body["max_tokens"] < 1:
        raise ApiError("'max_tokens' is required: a positive integer", "max_tokens")
    messages = read_messages(body)
    if body.get("system") is not None:
        system = read_content(body["system"], "system")
        if system:
            messages = [{"role": "system", "content": system}, *messages]
    fields = {"max_tokens": body["max_tokens"], "stop": body.get("stop_sequences") or [],
              **{k: body[k] for k in ("temperature", "top_p", "top_k", "stream") if k in body}}
    return messages, fields


def read_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError("'prompt' must be a string", "prompt")
    return prompt


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
