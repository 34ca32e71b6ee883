"""mlxllama's chat template renderer against renderings recorded from Hugging Face transformers.

The reference is made by scripts/make_template_expectations.py; rerun it when a built-in template or
the conversations change.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import pytest
from gguf import GGUFReader

from mlxllama import chat_template
from mlxllama.chat_template import (
    TemplateError,
    builtin_template,
    builtin_template_names,
    match_builtin,
    render_chat,
)

from conftest import REFERENCE, SHARED, skip_missing

RENDERINGS = json.loads((REFERENCE / "template_renderings.json").read_text(encoding="utf-8"))
# The 70 published templates live next to the checkout, as the models do.
SHARED_TEMPLATES = SHARED / "templates"
CHAT_TINY = Path(chat_template.__file__).parent / "data" / "chat-tiny-Q4_K_M.gguf"


@lru_cache(maxsize=None)
def template_source(key: str) -> str:
    kind, name = key.split(":", 1)
    if kind == "builtin":
        source = builtin_template(name)
    else:
        path = SHARED_TEMPLATES / f"{name}.jinja"
        if not path.is_file():
            skip_missing(path)
        source = path.read_text(encoding="utf-8")
    if hashlib.sha256(source.encode("utf-8")).hexdigest() != RENDERINGS["template_sha256"][key]:
        pytest.fail(f"{key} changed since the reference was made; rerun scripts/make_template_expectations.py")
    return source


@lru_cache(maxsize=1)
def chat_tiny_template() -> str:
    field = GGUFReader(CHAT_TINY).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode("utf-8")


@pytest.fixture
def fixed_now(monkeypatch):
    now = datetime.fromisoformat(RENDERINGS["now"])

    class FixedDatetime(datetime):
        @classmethod
        def now(cls, tz=None):
            return now

    monkeypatch.setattr(chat_template, "datetime", FixedDatetime)


def _case_id(case: dict) -> str:
    return f"{case['template']}-{case['conversation']}-{'gen' if case['add_generation_prompt'] else 'nogen'}"


@pytest.mark.parametrize("case", RENDERINGS["renderings"], ids=_case_id)
def test_matches_transformers(case, fixed_now):
    conversation = RENDERINGS["conversations"][case["conversation"]]
    args = (template_source(case["template"]), conversation["messages"])
    kwargs = dict(
        tools=conversation["tools"],
        add_generation_prompt=case["add_generation_prompt"],
        bos_token=RENDERINGS["bos_token"],
        eos_token=RENDERINGS["eos_token"],
        template_name=case["template"],
    )
    if "text" in case:
        assert render_chat(*args, **kwargs) == case["text"]
        return
    with pytest.raises(TemplateError) as raised:
        render_chat(*args, **kwargs)
    message = str(raised.value)
    assert "\n" not in message and case["template"] in message
    if "error" in case:
        assert case["error"] in message
    else:
        # transformers' record reads "ExceptionType: message"; Jinja's own types are not repeated here.
        assert case["exception"].split(": ", 1)[1] in message


def test_reference_covers_every_builtin():
    recorded = {key.split(":", 1)[1] for key in RENDERINGS["template_sha256"] if key.startswith("builtin:")}
    assert recorded == set(builtin_template_names())


def test_syntax_error_names_template_and_line():
    with pytest.raises(TemplateError) as raised:
        render_chat("{% for m in messages %}\n{{ m.content }}\n{% endfor\n", [], template_name="broken.jinja")
    message = str(raised.value)
    assert "'broken.jinja'" in message and "line 3" in message and "\n" not in message


def test_undefined_name_reports_line():
    template = "{% for m in messages %}\n{{ m.content }}\n{{ nothing.here }}\n{% endfor %}"
    with pytest.raises(TemplateError) as raised:
        render_chat(template, [{"role": "user", "content": "hi"}], template_name="t")
    message = str(raised.value)
    assert "\n" not in message
    assert message == "chat template 't', line 3: 'nothing' is undefined"


def test_python_error_reports_type_and_line():
    with pytest.raises(TemplateError) as raised:
        render_chat("\n\n{{ messages[0].content + 1 }}", [{"role": "user", "content": "hi"}], template_name="t")
    assert str(raised.value).startswith("chat template 't', line 3: TypeError: ")


def test_raise_exception_message_is_kept():
    with pytest.raises(TemplateError) as raised:
        render_chat("{{ raise_exception('Only user and assistant roles are supported!') }}", [], template_name="t")
    assert str(raised.value) == "chat template 't': Only user and assistant roles are supported!"


def test_tojson_keeps_non_ascii_and_takes_options():
    template = (
        "{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':'), sort_keys=true) }}"
    )
    out = render_chat(template, [], tools=[{"name": "météo", "desc": "<b>&'"}], x={"b": 1, "a": [1, 2]})
    compact, indented, sorted_ = out.split("|")
    assert compact == '[{"name": "météo", "desc": "<b>&\'"}]'
    assert indented == '[\n  {\n    "name": "météo",\n    "desc": "<b>&\'"\n  }\n]'
    assert sorted_ == '{"a":[1,2],"b":1}'


def test_extra_kwargs_and_defaults_reach_template():
    template = "{{ enable_thinking }} {{ date_string }} {{ tools }} {{ documents }} {{ bos_token }}{{ eos_token }}"
    rendered = render_chat(template, [], enable_thinking=False, date_string="1 Jan 2025")
    assert rendered == "False 1 Jan 2025 None None <s></s>"


def test_strftime_now_and_loopcontrols(fixed_now):
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
        " {{ strftime_now('%d %b %Y') }}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_chat(template, messages) == "a 05 Mar 2025"


def test_messages_are_prepared_like_apply_chat_template():
    template = "{% for m in messages %}{{ m | tojson(sort_keys=true) }}{% endfor %}"
    messages = [{"role": "assistant", "content": None, "reasoning": "think"}]
    assert render_chat(template, messages) == (
        '{"reasoning": "think", "reasoning_content": "think", "role": "assistant", "thinking": "think"}'
    )


def test_generation_block_renders_its_body():
    template = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert render_chat(template, [{"role": "assistant", "content": "ok"}]) == "ok"


def test_sandbox_refuses_mutation():
    with pytest.raises(TemplateError):
        render_chat("{{ messages.append(1) }}", [])


def test_unknown_builtin_lists_names():
    with pytest.raises(TemplateError) as raised:
        builtin_template("nope")
    message = str(raised.value)
    assert "nope" in message
    assert all(name in message for name in builtin_template_names())


def test_builtin_names():
    assert {"zephyr", "llama2", "llama3", "chatml", "mistral", "gemma", "phi3"} <= set(builtin_template_names())


def test_zephyr_is_chat_tiny_template():
    assert builtin_template("zephyr") == chat_tiny_template()
    assert match_builtin(chat_tiny_template()) == "zephyr"
    assert match_builtin("  " + chat_tiny_template().replace("\n", "\r\n") + "\n") == "zephyr"
    assert match_builtin("{{ messages }}") is None


def test_chat_tiny_rendering():
    messages = [{"role": "user", "content": "What is the capital of Japan?"}]
    assert render_chat(chat_tiny_template(), messages, add_generation_prompt=True) == (
        "<|user|>\nWhat is the capital of Japan?</s>\n<|assistant|>\n"
    )
