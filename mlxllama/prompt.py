"""From what the user typed to the token ids the model is fed: pick a template, render, tokenize."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

from .chat_template import builtin_template, builtin_template_names, match_builtin, render_chat
from .errors import MlxLlamaError
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Template:
    """A chat template and where it came from; `text is None` means no template (raw prompt)."""

    label: str  # built-in name, file path, "gguf" (with the matching built-in name if any), or "none"
    text: str | None


NO_TEMPLATE = Template("none", None)


def choose_template(
    gguf_template: str | None, name: str | None = None, path: str | None = None, no_template: bool = False
) -> Template:
    """--no-template, then --template NAME, then --template-file PATH, then the GGUF's own template."""
    if no_template:
        return NO_TEMPLATE
    if name:
        return Template(name, builtin_template(name))
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return Template(os.fspath(path), f.read())
        except (OSError, UnicodeDecodeError) as e:
            raise MlxLlamaError(f"{path}: cannot read template file ({e.strerror if isinstance(e, OSError) else e})")
    if gguf_template:
        builtin = match_builtin(gguf_template)
        return Template(f"gguf ({builtin})" if builtin else "gguf", gguf_template)
    raise MlxLlamaError(
        "the model has no chat template; pass --template NAME "
        f"({', '.join(builtin_template_names())}), --template-file PATH, or --no-template"
    )


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]
    template: str


def with_system(system: str | None, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """messages with the system message first, unless there is none or they already have one."""
    if not system or any(m["role"] == "system" for m in messages):
        return list(messages)
    return [{"role": "system", "content": system}, *messages]


def messages_for(user: str, system: str | None = None) -> list[dict[str, str]]:
    return with_system(system, [{"role": "user", "content": user}])


def render_messages(template: Template, tokenizer: Tokenizer, messages: Sequence[dict[str, Any]],
                    add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> str:
    return render_chat(
        template.text,
        list(messages),
        add_generation_prompt=add_generation_prompt,
        bos_token=tokenizer.special_token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else "",
        eos_token=tokenizer.special_token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else "",
        template_name=template.label,
        **(template_kwargs or {}),
    )


def tokenize_rendered(tokenizer: Tokenizer, text: str) -> list[int]:
    """Control tokens written by the template become their ids, and BOS is not doubled when the template emits it."""
    ids = tokenizer.encode(text, add_bos=True, special=True)
    if len(ids) > 1 and ids[0] == ids[1] == tokenizer.bos_id:
        ids = ids[1:]
    return ids


def build_prompt(tokenizer: Tokenizer, template: Template, messages: Sequence[dict[str, Any]],
                 template_kwargs: dict | None = None) -> Prompt:
    """Without a template, the last user message is fed as raw text, with BOS where the vocabulary adds one."""
    if template.text is None:
        text = messages[-1]["content"]
        return Prompt(text, tokenizer.encode(text, add_bos=True, special=False), template.label)
    text = render_messages(template, tokenizer, messages, True, template_kwargs)
    return Prompt(text, tokenize_rendered(tokenizer, text), template.label)
