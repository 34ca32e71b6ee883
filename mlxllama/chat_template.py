"""Chat templates rendered exactly as Hugging Face transformers' `apply_chat_template` renders them.

A GGUF file carries its model's Jinja template in `tokenizer.chat_template`, written for transformers'
renderer; any difference in the environment (whitespace control, filters, globals, variables) changes
the prompt the model sees, so this module reproduces that environment rather than plain Jinja's.

Templates come from strangers, so rendering is sandboxed and bounded: touching an internal
attribute (`__class__`, `__globals__`, ...) fails at once; a rendering that runs longer than
MAX_RENDER_SECONDS is stopped; and an operation that would make a string or list longer than
MAX_OUTPUT_CHARS (`*`, `+`, `~`, `%`, `str.format`, the widening filters, a width passed to a
method) is refused before it allocates, as is output beyond that size. Each ends in a
TemplateError that names the limit. Memory grown in steps this module does not check (a dict
gaining keys in a loop) is still bounded by the time limit.
"""

from __future__ import annotations

import json
import re
import string
import sys
import time
from datetime import datetime
from functools import lru_cache, update_wrapper
from importlib import resources
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .errors import MlxLlamaError

_BUILTIN_PACKAGE = "mlxllama.templates"
_BUILTIN_SUFFIX = ".jinja"
# The filename Jinja gives templates compiled from a string; their frames in a traceback carry it.
_JINJA_STRING_FILENAME = "<template>"
# Names a message's reasoning arrives under, the one templates read first.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")

# Limits of one rendering. Real templates render in milliseconds to a few kilobytes; 4M characters
# is about a million tokens, more than any model's context.
MAX_RENDER_SECONDS = 2.0
MAX_OUTPUT_CHARS = 4_000_000
MAX_INT_BITS = 4096
# A printf conversion's width and precision ("%-10.3f", "%*s").
_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?")


class TemplateError(MlxLlamaError):
    """A chat template that does not compile, fails while rendering, or rejects the conversation."""


class _Rejected(Exception):
    """Raised by the template's own `raise_exception()`: its message is meant for the user as is."""


class _OverLimit(Exception):
    """A rendering that went over MAX_RENDER_SECONDS or MAX_OUTPUT_CHARS."""


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


def _check_size(size: int, what: str) -> None:
    if size > MAX_OUTPUT_CHARS:
        raise _OverLimit(f"{what} would be {size} long, more than the limit of {MAX_OUTPUT_CHARS}")


def _check_printf(fmt: str, args: Any) -> None:
    # `'%999999999d' % 1` allocates its width at once, before any other check could run.
    numbers = [a for a in (args if isinstance(args, tuple) else (args,)) if isinstance(a, int)]
    for field in _PRINTF_FIELD.findall(fmt):
        for part in field:
            _check_size(max(numbers, default=0) if part == "*" else int(part or 0), "a formatted field")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would be huge, before Python allocates it."""
    sized = (str, list, tuple)
    if operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if isinstance(sequence, sized) and isinstance(count, int):
                _check_size(len(sequence) * count, "a repeated string or list")
    elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        _check_size(len(left) + len(right), "a concatenation")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        bits = right * abs(left).bit_length()
        if bits > MAX_INT_BITS:
            raise _OverLimit(f"{left} ** {right} would be a number of about {bits} bits, more than the limit of "
                             f"{MAX_INT_BITS}")
    elif operator == "%" and isinstance(left, str):
        _check_printf(left, right)


def _center_size(value: Any, width: int = 80) -> int:
    return max(len(str(value)), int(width))


def _indent_size(value: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> int:
    text = str(value)
    return len(text) + (text.count("\n") + 1) * (width if isinstance(width, int) else len(str(width)))


def _replace_size(eval_ctx: Any, value: Any, old: Any, new: Any, count: int | None = None) -> int:
    text, old, new = str(value), str(old), str(new)
    hits = text.count(old) if old else len(text) + 1
    if count is not None and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(len(new) - len(old), 0)


def _format_size(value: Any, *args: Any, **kwargs: Any) -> int:
    _check_printf(str(value), kwargs or args)
    return 0


# Filters whose result can be far larger than their arguments, with the size the result would have.
_EXPANDING_FILTERS = {"center": _center_size, "indent": _indent_size, "replace": _replace_size,
                      "format": _format_size}


def _size_checked(name: str, func: Any, size: Any) -> Any:
    def checked(*args: Any, **kwargs: Any) -> Any:
        _check_size(size(*args, **kwargs), f"the result of |{name}")
        return func(*args, **kwargs)

    # update_wrapper also copies Jinja's pass_eval_context marker, so the arguments stay the same.
    return update_wrapper(checked, func)


def _size_checked_join(join: Any) -> Any:
    def checked(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
        items = list(value)  # a generator can be read only once: measure and join the same items
        if attribute is None:
            joined = sum(len(str(item)) for item in items) + len(str(d)) * max(len(items) - 1, 0)
            _check_size(joined, "the result of |join")
        return join(eval_ctx, items, d, attribute)

    return update_wrapper(checked, join)


def _check_format_spec(fmt: str) -> None:
    # `'{:999999999}'.format(1)`, like printf widths, allocates before anything else could stop it.
    for _, _, spec, _ in string.Formatter().parse(fmt):
        for number in re.findall(r"\d+", spec or ""):
            _check_size(int(number), "a formatted field")


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, failing loudly on internals and checking sizes of what can blow up."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        # A width or count passed to a method (`'x'.ljust(10**10)`) is allocated inside the call.
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and value > MAX_OUTPUT_CHARS:
                raise _OverLimit(f"a call with the argument {value}, more than the limit of {MAX_OUTPUT_CHARS}")
        return super().call(context, obj, *args, **kwargs)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Jinja's default is an undefined value that fails only when called, so `{{ ''.__class__ }}`
        # would print nothing; failing at the access tells the user what the template reached for.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format_spec(value.__self__)
        return wrapped


class _Budget:
    """Stops a rendering that runs past its deadline, checked at each line of the compiled template.

    Lines of the template's own code are where any loop of it runs, output or not, so
    `{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}` is stopped too.
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise _OverLimit(f"rendering took longer than {self.seconds:g} s")

    def on_call(self, frame: Any, event: str, arg: Any) -> Any:
        # Only compiled-template frames are traced line by line; Python's and Jinja's own run untraced.
        return self.on_line if frame.f_code.co_filename == _JINJA_STRING_FILENAME else None

    def on_line(self, frame: Any, event: str, arg: Any) -> Any:
        self.check()
        return self.on_line


def _render_bounded(compiled: jinja2.Template, context: dict) -> str:
    budget = _Budget(MAX_RENDER_SECONDS)
    pieces, size = [], 0
    previous = sys.gettrace()  # a debugger's or coverage's tracer, put back afterwards
    sys.settrace(budget.on_call)
    try:
        for piece in compiled.generate(context):
            size += len(piece)
            _check_size(size, "the rendered prompt")
            pieces.append(piece)
    finally:
        sys.settrace(previous)
    return "".join(pieces)


def _make_environment() -> ImmutableSandboxedEnvironment:
    # Templates come from downloaded files, so they run sandboxed and cannot mutate the messages.
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    for name, size in _EXPANDING_FILTERS.items():
        env.filters[name] = _size_checked(name, env.filters[name], size)
    env.filters["join"] = _size_checked_join(env.filters["join"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_environment()


def _checked_str_join(parts: Any) -> str:
    parts = [str(part) for part in parts]
    _check_size(sum(map(len, parts)), "a concatenation")
    return "".join(parts)


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    compiled = _ENV.from_string(source)
    # `~` compiles to a call of the template module's own `str_join`, which no sandbox hook sees;
    # checking it keeps `{% set ns.s = ns.s ~ ns.s %}` in a loop from taking gigabytes in 2 seconds.
    compiled.root_render_func.__globals__["str_join"] = _checked_str_join
    return compiled


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
        return _render_bounded(compiled, context)
    except _Rejected as e:
        raise TemplateError(f"{_where(template_name, None)}: {_one_line(str(e))}") from e
    except _OverLimit as e:
        raise TemplateError(f"{_where(template_name, _template_line(e))}: stopped: {e}") from e
    except SecurityError as e:
        raise TemplateError(f"{_where(template_name, _template_line(e))}: refused by the sandbox: {e}") from e
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
