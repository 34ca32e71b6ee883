"""A multi-turn conversation whose history lives in the KV cache.

Each turn re-renders the whole conversation with the template, keeps the cached tokens that still
match the new rendering, and feeds only the rest, so turn two costs only its new suffix.
"""

from __future__ import annotations

import json
from typing import Callable, Iterator

from .errors import MlxLlamaError, count
from .files import write_text_atomic
from .generate import TextStream
from .prompt import Template, render_messages, tokenize_rendered, with_system
from .runtime import Runtime
from .sampling import SamplingParams, make_sampler


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatSession:
    def __init__(self, runtime: Runtime, template: Template, system: str | None = None,
                 params: SamplingParams = SamplingParams(), max_tokens: int = 256, stop: tuple[str, ...] = (),
                 template_kwargs: dict | None = None, notify: Callable[[str], None] = lambda message: None):
        if template.text is None:
            raise MlxLlamaError("chat needs a chat template; pass --template NAME or --template-file PATH")
        self.runtime, self.template = runtime, template
        self.params, self.max_tokens, self.stop = params, max_tokens, stop
        self.template_kwargs = template_kwargs or {}
        self.notify = notify
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.cache = runtime.new_cache()
        self.cached_ids: list[int] = []  # exactly the tokens the cache holds
        self.last_fed = 0  # tokens fed on the last turn (prompt suffix + reply)

    def reset(self) -> None:
        self.messages = []
        self.forget_cache()

    def forget_cache(self) -> None:
        self.cache = self.runtime.new_cache()
        self.cached_ids = []

    def set_system(self, text: str | None) -> None:
        self.system = text or None

    def conversation(self) -> list[dict[str, str]]:
        return with_system(self.system, self.messages)

    def _prompt_ids(self) -> list[int]:
        text = render_messages(self.template, self.runtime.tokenizer, self.conversation(), True, self.template_kwargs)
        return tokenize_rendered(self.runtime.tokenizer, text)

    def _fit_context(self) -> list[int]:
        """Prompt ids for the conversation, dropping the oldest turns while it leaves no room to reply."""
        context = self.runtime.config.context_length
        ids = self._prompt_ids()
        while len(ids) >= context - min(self.max_tokens, context // 4):
            if len(self.messages) <= 1:
                raise MlxLlamaError(f"the message is {count(len(ids), 'token')}, too long for the model's context of {context}")
            dropped = 2 if len(self.messages) > 2 else 1
            del self.messages[:dropped]
            self.notify(f"context full: dropped the oldest {dropped} message(s)")
            ids = self._prompt_ids()
        return ids

    def send(self, user_text: str) -> Iterator[str]:
        """Stream the assistant's reply; the reply joins the history once complete.

        A turn that fails or is interrupted leaves the conversation as it was before it.
        """
        before = list(self.messages)
        self.messages.append({"role": "user", "content": user_text})
        try:
            prompt_ids = self._fit_context()
        except BaseException:
            self.messages = before
            raise
        keep = common_prefix_length(self.cached_ids, prompt_ids)
        if keep == len(prompt_ids):
            keep -= 1  # the last prompt token must be fed to get logits for the reply
        for layer in self.cache:
            layer.trim(layer.offset - keep)
        self.cached_ids = self.cached_ids[:keep]
        stream = TextStream(self.runtime.model, self.runtime.tokenizer, self.cache, prompt_ids,
                            make_sampler(self.params), self.max_tokens, self.stop, new_ids=prompt_ids[keep:])
        try:
            yield from stream
        except BaseException:
            # An interrupted step may have left some layers' caches a token ahead of others.
            self.forget_cache()
            self.messages = before
            raise
        result = stream.result
        self.last_fed = len(prompt_ids) - keep + len(result.token_ids)
        self.cached_ids = prompt_ids + result.token_ids
        self.messages.append({"role": "assistant", "content": result.text})
        self.last_result = result

    def save(self, path: str) -> None:
        """Write a JSON transcript of the completed turns to a regular file (a symbolic link's target),
        atomically: Ctrl-C or a full disk meanwhile leaves the old file or the new one."""
        transcript = {"model": self.runtime.path, "template": self.template.label, "messages": self.conversation()}
        write_text_atomic(path, json.dumps(transcript, ensure_ascii=False, indent=2) + "\n")
