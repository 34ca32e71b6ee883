"""`mlxllama serve`'s HTTP API, OpenAI-compatible: an ASGI app (Starlette) over the engine.

Routes: POST /v1/chat/completions (the chat template applied explicitly; `chat_template` picks
another or "none"), POST /v1/completions (the raw prompt, as `generate --no-template`), GET
/v1/models, GET /health, POST /tokenize and /detokenize (llama-server's). Streaming is server-sent
events. `return_prompt: true` adds the rendered prompt and its token ids to a response.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..batching import Request
from ..errors import MlxLlamaError
from ..generate import GenerationResult, check_fits
from ..prompt import NO_TEMPLATE, Prompt, Template, build_prompt, choose_template, messages_for
from ..sampling import SamplingParams
from .engine import Engine, Ticket
from .protocol import ApiError, Settings, read_messages, read_prompt, read_settings


@dataclass
class ServerSettings:
    template: Template  # the server's chat template (--template, --template-file or the file's)
    params: SamplingParams  # the sampling defaults, as generate's options give them
    max_tokens: int
    api_key: str | None = None


def create_app(runtime, engine: Engine, settings: ServerSettings) -> Starlette:
    api = Api(runtime, engine, settings)
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={Exception: api.unexpected})


class Api:
    def __init__(self, runtime, engine: Engine, settings: ServerSettings):
        self.runtime, self.engine, self.settings = runtime, engine, settings
        self.model_id = os.path.basename(runtime.path)
        self.created = int(time.time())

    # ---- the routes ----------------------------------------------------------------------------

    async def health(self, request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok", "requests_running": self.engine.running})

    async def models(self, request: HttpRequest) -> Response:
        return await self._guarded(request, lambda body: JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "mlxllama"}]}), read=False)

    async def chat_completions(self, request: HttpRequest) -> Response:
        async def handle(body: dict) -> Response:
            settings = read_settings(body, self.settings.params, self.settings.max_tokens, {"messages"})
            messages = read_messages(body)
            template = self._template(settings.template)
            try:
                prompt = build_prompt(self.runtime.tokenizer, template, messages, settings.template_kwargs)
            except MlxLlamaError as e:
                raise ApiError(str(e), "messages") from None
            return await self._respond(prompt, settings, chat=True)

        return await self._guarded(request, handle)

    async def completions(self, request: HttpRequest) -> Response:
        async def handle(body: dict) -> Response:
            settings = read_settings(body, self.settings.params, self.settings.max_tokens, {"prompt"})
            prompt = build_prompt(self.runtime.tokenizer, NO_TEMPLATE, messages_for(read_prompt(body)))
            return await self._respond(prompt, settings, chat=False)

        return await self._guarded(request, handle)

    async def tokenize(self, request: HttpRequest) -> Response:
        async def handle(body: dict) -> Response:
            content = body.get("content")
            if not isinstance(content, str):
                raise ApiError("'content' must be a string", "content")
            add_special, parse_special = body.get("add_special", False), body.get("parse_special", True)
            if not isinstance(add_special, bool) or not isinstance(parse_special, bool):
                raise ApiError("'add_special' and 'parse_special' must be true or false", "add_special")
            ids = self.runtime.tokenizer.encode(content, add_bos=add_special, special=parse_special)
            if body.get("with_pieces"):
                tokenizer = self.runtime.tokenizer
                return JSONResponse({"tokens": [{"id": i, "piece": tokenizer.id_to_piece(i)} for i in ids]})
            return JSONResponse({"tokens": ids})

        return await self._guarded(request, handle)

    async def detokenize(self, request: HttpRequest) -> Response:
        async def handle(body: dict) -> Response:
            tokens = body.get("tokens")
            vocab = self.runtime.tokenizer.vocab_size
            if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
                raise ApiError(f"'tokens' must be a list of token ids below {vocab}", "tokens")
            return JSONResponse({"content": self.runtime.tokenizer.decode(tokens)})

        return await self._guarded(request, handle)

    async def unexpected(self, request: HttpRequest, error: Exception) -> Response:
        """A failure no check foresaw: a 500 for this request alone, with no traceback in it."""
        return JSONResponse(ApiError(f"internal error ({type(error).__name__})", status=500,
                                     kind="server_error").body(), status_code=500)

    # ---- shared ----------------------------------------------------------------------------------

    async def _guarded(self, request: HttpRequest, handle, read: bool = True) -> Response:
        """Check the API key, read the JSON body, and answer an ApiError with its status and body."""
        try:
            self._authorize(request)
            if not read:
                return handle({})
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as e:
                raise ApiError(f"the body is not valid JSON ({e})") from None
            if not isinstance(body, dict):
                raise ApiError("the body must be a JSON object")
            return await handle(body)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)

    def _authorize(self, request: HttpRequest) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError("invalid or missing API key (Authorization: Bearer KEY)", status=401,
                           kind="authentication_error", code="invalid_api_key")

    def _template(self, name: str | None) -> Template:
        if name is None:
            return self.settings.template
        if name == "none":
            return NO_TEMPLATE
        try:
            return choose_template(self.runtime.chat_template, name)
        except MlxLlamaError as e:
            raise ApiError(str(e), "chat_template") from None

    async def _respond(self, prompt: Prompt, settings: Settings, chat: bool) -> Response:
        try:
            check_fits(len(prompt.ids), self.runtime.config.context_length)
        except MlxLlamaError as e:
            raise ApiError(str(e), "messages" if chat else "prompt", code="context_length_exceeded") from None
        request = Request(prompt.ids, settings.max_tokens, settings.params, settings.stop)
        completion = Completion(self, prompt, settings, chat)
        events = completion.submit(request)
        if settings.stream:
            return StreamingResponse(completion.stream(events), media_type="text/event-stream")
        return JSONResponse(await completion.whole(events))


class Completion:
    """One request's answer, in OpenAI's shapes: whole, or as a stream of chunks."""

    def __init__(self, api: Api, prompt: Prompt, settings: Settings, chat: bool):
        self.api, self.prompt, self.settings, self.chat = api, prompt, settings, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.ticket: Ticket | None = None

    def submit(self, request: Request) -> asyncio.Queue:
        """Hand the request to the engine; its events arrive on the returned queue:
        ("text", piece), then ("done", result) or ("error", exception)."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def post(kind: str):
            return lambda value: loop.call_soon_threadsafe(events.put_nowait, (kind, value))

        self.ticket = self.api.engine.submit(Ticket(request, post("text"), post("done"), post("error")))
        return events

    async def whole(self, events: asyncio.Queue) -> dict:
        try:
            while True:
                kind, value = await events.get()
                if kind == "error":
                    raise value
                if kind == "done":
                    return self._whole_body(value)
        except asyncio.CancelledError:
            self.ticket.cancel()
            raise

    async def stream(self, events: asyncio.Queue) -> AsyncIterator[str]:
        try:
            if self.chat:
                yield self._event(self._chunk({"role": "assistant", "content": ""}))
            while True:
                kind, value = await events.get()
                if kind == "text":
                    yield self._event(self._chunk({"content": value} if self.chat else value))
                elif kind == "error":
                    yield self._event(ApiError(f"generation failed ({type(value).__name__})", status=500,
                                               kind="server_error").body())
                    break
                else:
                    yield self._event(self._chunk({} if self.chat else "", value.finish_reason,
                                                  self._extras(value)))
                    if self.settings.include_usage:
                        yield self._event({**self._head(), "choices": [], "usage": self._usage(value)})
                    break
            yield "data: [DONE]\n\n"
        finally:
            self.ticket.cancel()  # a client that went away frees its row at the next step

    # ---- shapes ------------------------------------------------------------------------------------

    def _head(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.api.model_id, "system_fingerprint": self._fingerprint()}

    def _chunk(self, delta: dict | str, finish_reason: str | None = None, extras: dict | None = None) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = delta
        else:
            choice.update(text=delta, logprobs=None)
        return {**self._head(), "choices": [choice], **(extras or {})}

    def _whole_body(self, result: GenerationResult) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "finish_reason": result.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}
        return {**self._head(), "object": "chat.completion" if self.chat else "text_completion",
                "choices": [choice], "usage": self._usage(result), **self._extras(result)}

    def _usage(self, result: GenerationResult) -> dict:
        prompt, completion = len(self.prompt.ids), len(result.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _extras(self, result: GenerationResult) -> dict:
        if not self.settings.return_prompt:
            return {}
        return {"prompt": {"template": self.prompt.template, "text": self.prompt.text, "token_ids": self.prompt.ids,
                           "completion_token_ids": result.token_ids}}

    def _fingerprint(self) -> str:
        return f"mlxllama:{self.api.model_id}:{self.prompt.template}"

    @staticmethod
    def _event(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
