"""A multi-turn conversation whose history lives in the KV cache.

Each turn re-renders the whole conversation with the template, takes from the prompt cache (the
store the server uses too) the keys and values of the longest prefix of that rendering it holds,
feeds only the rest, and puts the cache back when the reply is done: turn two costs only its new
suffix, and after /reset a system prompt seen before is not computed again.
"""

from __future__ import annotations

import json
from typing import Callable, Iterator

from .cache import GROWTH_STEP, check_kv_size, kv_bytes_per_position
from .errors import MlxLlamaError, count
from .files import write_text_atomic
from .generate import TextStream, prefill_chunk
from .prompt import Template, render_messages, tokenize_rendered, with_system
from .prompt_cache import PromptCache
from .runtime import Runtime
from .sampling import SamplingParams, make_sampler
from .speculative import Speculation


class ChatSession:
    def __init__(self, runtime: Runtime, template: Template, system: str | None = None,
                 params: SamplingParams = SamplingParams(), max_tokens: int = 256, stop: tuple[str, ...] = (),
                 template_kwargs: dict | None = None, notify: Callable[[str], None] = lambda message: None,
                 prompt_cache: PromptCache | None = None, max_kv_size: int = 0, keep: int = 4,
                 speculation: Speculation | None = None):
        if template.text is None:
            raise MlxLlamaError("chat needs a chat template; pass --template NAME or --template-file PATH")
        self.runtime, self.template = runtime, template
        self.params, self.max_tokens, self.stop = params, max_tokens, stop
        self.template_kwargs = template_kwargs or {}
        self.notify = notify
        # A bounded KV cache (cache.RotatingKVCache) lets the conversation outgrow the context:
        # no turn is dropped, the cache keeps the first `keep` positions and the latest ones.
        check_kv_size(max_kv_size, keep, runtime.model.kv_quantization)
        self.max_kv_size, self.keep = max_kv_size, keep
        self.speculation = speculation  # drafts the model checks, or None
        self.system = system
        self.messages: list[dict[str, str]] = []
        # Room for the conversation at its longest and one earlier prefix (a system prompt after /reset).
        model = runtime.model
        per_position = kv_bytes_per_position(runtime.config, model.compute_dtype, model.kv_quantization)
        # A rotating cache may hold a prefill chunk beyond its bound while it fills.
        held = max(runtime.config.context_length, max_kv_size + prefill_chunk()) + GROWTH_STEP
        self.prompt_cache = prompt_cache or PromptCache(2 * held * per_position)
        self.last_cached = 0  # prompt tokens the last turn found in the prompt cache
        self.last_fed = 0  # tokens fed on the last turn (prompt suffix + reply)

    def reset(self) -> None:
        self.messages = []

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
        while not self.max_kv_size and len(ids) >= context - min(self.max_tokens, context // 4):
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
        cache, keep = self.prompt_cache.take(prompt_ids, self.runtime.model, self.max_kv_size, self.keep)
        sampler = make_sampler(self.params, self.runtime.model.sampling_group)
        stream = TextStream(self.runtime.model, self.runtime.tokenizer, cache, prompt_ids, sampler, self.max_tokens,
                            self.stop, new_ids=prompt_ids[keep:], speculate=self.speculation)
        try:
            yield from stream
        except BaseException:
            # The cache is not put back: an interrupted step may have left some layers a token ahead of others.
            self.messages = before
            raise
        result = stream.result
        self.last_cached, self.last_fed = keep, len(prompt_ids) - keep + len(result.token_ids)
        self.prompt_cache.put(prompt_ids + result.token_ids, cache)
        self.messages.append({"role": "assistant", "content": result.text})
        self.last_result = result

    def save(self, path: str) -> None:
        """Write a JSON transcript of the completed turns to a regular file (a symbolic link's target),
        atomically: Ctrl-C or a full disk meanwhile leaves the old file or the new one."""
        transcript = {"model": self.runtime.path, "template": self.template.label, "messages": self.conversation()}
        write_text_atomic(path, json.dumps(transcript, ensure_ascii=False, indent=2) + "\n")
