"""Hostile chat templates: refused by the sandbox, or stopped by the limits on render time and size."""

from __future__ import annotations

import sys
import time

import pytest
from click.testing import CliRunner

from mlxllama import chat_template
from mlxllama.chat_template import TemplateError, render_chat
from mlxllama.cli import main

MESSAGES = [{"role": "user", "content": "hi"}]


def render_error(template: str, **kwargs) -> str:
    with pytest.raises(TemplateError) as raised:
        render_chat(template, MESSAGES, template_name="evil.jinja", **kwargs)
    message = str(raised.value)
    assert message.startswith("chat template 'evil.jinja'") and "\n" not in message
    return message


@pytest.mark.parametrize("template, refused", [
    ("{{ ''.__class__ }}", "attribute '__class__' of 'str' object"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "attribute '__class__' of 'str' object"),
    ("{{ messages.__class__.__subclasses__() }}", "attribute '__class__' of 'list' object"),
    ("{{ cycler.__init__.__globals__ }}", "attribute '__init__' of 'type' object"),
    ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", "attribute '__init__' of 'type' object"),
    ("{{ self.__init__ }}", "attribute '__init__' of 'TemplateReference' object"),
    ("{{ lipsum.__globals__['os'] }}", "attribute '__globals__' of 'function' object"),
    ("{{ messages['__class__'] }}", "attribute '__class__' of 'list' object"),
    ("{{ messages | attr('__class__') }}", "attribute '__class__' of 'list' object"),
    ("{{ raise_exception.__code__ }}", "attribute '__code__' of 'function' object"),
    ("{{ messages.append(1) }}", "attribute 'append' of 'list' object"),
])
def test_internals_are_refused_at_the_first_touch(template, refused):
    """Jinja's sandbox would print `{{ ''.__class__ }}` as nothing; here it is an error that says why."""
    assert f"refused by the sandbox: access to {refused} is unsafe" in render_error(template)


@pytest.mark.parametrize("template, error", [
    ("{{ x.__subclasses__() }}", "'str object' has no attribute '__subclasses__'"),
    ("{{ os.popen('id').read() }}", "'os' is undefined"),
    ("{{ __import__('os') }}", "'__import__' is undefined"),
])
def test_names_outside_the_sandbox_do_not_exist(template, error):
    assert error in render_error(template, x="text")


@pytest.mark.parametrize("template, refused", [
    ("{% for i in range(10**12) %}x{% endfor %}", "stopped: a call with the argument 1000000000000"),
    ("{% for i in range(10**9) %}{% endfor %}", "stopped: a call with the argument 1000000000"),
    ("{{ range(1000000) | list | length }}", "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000)"),
])
def test_huge_ranges_are_refused(template, refused):
    assert refused in render_error(template)


@pytest.mark.parametrize("template, what", [
    ("{{ 'a' * 10**10 }}", "a repeated string or list would be 10000000000 long"),
    ("{{ 10**10 * 'a' }}", "a repeated string or list would be 10000000000 long"),
    ("{{ [0] * 10**10 }}", "a repeated string or list would be 10000000000 long"),
    ("{{ 10 ** 100000 }}", "10 ** 100000 would be a number of about 400000 bits"),
    ("{{ '%999999999d' % 1 }}", "a formatted field would be 999999999 long"),
    ("{{ '%*d' % (999999999, 1) }}", "a formatted field would be 999999999 long"),
    ("{{ '%999999999d' | format(1) }}", "a formatted field would be 999999999 long"),
    ("{{ '{:999999999}'.format(1) }}", "a formatted field would be 999999999 long"),
    ("{{ 'a' | center(10**10) }}", "the result of |center would be 10000000000 long"),
    ("{{ 'a\na' | indent(10**9) }}", "the result of |indent would be 2000000003 long"),
    ("{{ range(100000) | join('x' * 1000) }}", "the result of |join would be"),
    ("{{ ('ab' * 2000000) | replace('a', 'aaa') }}", "the result of |replace would be 8000000 long"),
    ("{{ 'x'.ljust(10**10) }}", "a call with the argument 10000000000"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "a concatenation would be 4194304 long"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "a concatenation would be 4194304 long"),
])
def test_values_too_large_are_refused_before_they_are_made(template, what):
    start = time.monotonic()
    message = render_error(template)
    assert f"stopped: {what}" in message and ", more than the limit of " in message
    assert time.monotonic() - start < 1.0


@pytest.fixture
def short_time_limit(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.3)


@pytest.mark.parametrize("template", [
    # No output and no call in the inner loop: only the time limit can stop these.
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set l = range(100000) | list %}"
    "{% for i in l %}{% for j in l %}{% if i == j %}{% endif %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
])
def test_endless_rendering_is_stopped_by_the_time_limit(template, short_time_limit):
    start = time.monotonic()
    assert "stopped: rendering took longer than 0.3 s" in render_error(template)
    assert time.monotonic() - start < 2.0


def test_output_beyond_the_limit_is_stopped(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_OUTPUT_CHARS", 100_000)
    template = "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}"
    assert "stopped: the rendered prompt would be 100010 long, more than the limit of 100000" in render_error(template)


def test_deep_recursion_is_an_error():
    assert "RecursionError" in render_error("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")


def test_a_tracer_set_before_rendering_is_put_back(short_time_limit):
    def tracer(frame, event, arg):
        return None

    sys.settrace(tracer)
    try:
        render_chat("{{ messages[0].content }}", MESSAGES)
        render_error("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


def test_ordinary_templates_are_not_limited():
    template = ("{% for i in range(1000) %}{{ (i|string) * 3 }}{{ '%5d' % i }}{{ 'ab' | center(6) }}{% endfor %}"
                "{{ range(3) | join(', ') }}{{ '{:>4}'.format('x') }}{{ 2 ** 64 }}")
    out = render_chat(template, MESSAGES)
    assert out.endswith("0, 1, 2   x18446744073709551616") and len(out) > 10_000


def test_cli_reports_a_hostile_template_in_one_line(tmp_path):
    evil = tmp_path / "evil.jinja"
    evil.write_text("{% for m in messages %}{{ m.__class__.__mro__ }}{% endfor %}")
    result = CliRunner().invoke(main, ["generate", "-p", "hi", "--template-file", str(evil)])
    assert result.exit_code == 2
    assert result.stderr == (f"mlxllama: error: chat template '{evil}', line 1: refused by the sandbox: "
                             "access to attribute '__class__' of 'dict' object is unsafe\n")
