"""Chat templates rendered exactly as Hugging Face transformers' `apply_chat_template` renders them.

A GGUF file carries its model's Jinja template in `tokenizer.chat_template`, written for transformers'
renderer; any difference in the environment (whitespace control, filters, globals, variables) changes
the prompt the model sees, so this module reproduces that environment rather than plain Jinja's.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from importlib import resources
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import MlxLlamaError

_BUILTIN_PACKAGE = "mlxllama.templates"
_BUILTIN_SUFFIX = ".jinja"
# The filename Jinja gives templates compiled from a string; their frames in a traceback carry it.
_JINJA_STRING_FILENAME = "<template>"
# Names a message's reasoning arrives under, the one templates read first.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class TemplateError(MlxLlamaError):
    """A chat template that does not compile, fails while rendering, or rejects the conversation."""


class _Rejected(Exception):
    """Raised by the template's own `raise_exception()`: its message is meant for the user as is."""


def _raise_exception(message: str) -> None:
    raise _Rejected(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own `tojson` HTML-escapes <, >, & and ' and takes no json.dumps options; templates
    # are written against transformers' version, which does neither.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}`, which transformers' templates use to mark assistant text.

    transformers records where the block's output lands (for training masks); rendering only needs
    its body. It stays a call block, as in transformers, so `set` inside keeps the same scope.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _make_environment() -> ImmutableSandboxedEnvironment:
    # Templates come from downloaded files, so they run sandboxed and cannot mutate the messages.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_environment()


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _template_line(exc: BaseException) -> int | None:
    # Jinja rewrites tracebacks so that template frames report template line numbers; the innermost
    # one is where the error happened (inside a macro, if it was in one).
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == _JINJA_STRING_FILENAME:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _where(template_name: str, line: int | None) -> str:
    return f"chat template '{template_name}'" + (f", line {line}" if line is not None else "")


def _prepare_message(message: dict) -> dict:
    # As apply_chat_template does: API clients send `"content": None` for tool calls, which many
    # templates would print as "None", and reasoning is copied to the names templates look for.
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_KEYS if key in message), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "<s>", eos_token: str = "</s>", *, template_name: str = "<template>",
                **kwargs: Any) -> str:
    """Render `messages` with a chat template; extra keyword arguments become template variables.

    Raises TemplateError (one line, naming `template_name`) when the template does not compile, fails
    while rendering, or rejects the conversation through `raise_exception`.
    """
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"{_where(template_name, e.lineno)}: syntax error: {_one_line(e.message or '')}") from e
    context = {
        # transformers always defines these two, so templates testing `is defined` see them.
        "tools": None,
        "documents": None,
        **kwargs,
        "messages": [_prepare_message(m) for m in messages],
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
    }
    try:
        return compiled.render(context)
    except _Rejected as e:
        raise TemplateError(f"{_where(template_name, None)}: {_one_line(str(e))}") from e
    except Exception as e:  # whatever a downloaded template does wrong, the user gets the same kind of report
        detail = str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
        raise TemplateError(f"{_where(template_name, _template_line(e))}: {_one_line(detail)}") from e


def builtin_template_names() -> list[str]:
    return sorted(
        entry.name[: -len(_BUILTIN_SUFFIX)]
        for entry in resources.files(_BUILTIN_PACKAGE).iterdir()
        if entry.name.endswith(_BUILTIN_SUFFIX)
    )


def builtin_template(name: str) -> str:
    names = builtin_template_names()
    if name not in names:
        raise TemplateError(f"unknown chat template '{name}'; built-in templates: {', '.join(names)}")
    return resources.files(_BUILTIN_PACKAGE).joinpath(name + _BUILTIN_SUFFIX).read_text(encoding="utf-8")


def _normalise_whitespace(text: str) -> str:
    return " ".join(text.split())


@lru_cache(maxsize=1)
def _normalised_builtins() -> dict[str, str]:
    return {_normalise_whitespace(builtin_template(name)): name for name in builtin_template_names()}


def match_builtin(template: str) -> str | None:
    """The built-in template this one is a copy of, ignoring differences in whitespace."""
    return _normalised_builtins().get(_normalise_whitespace(template))
