"""`mlxllama serve`'s HTTP API, OpenAI-compatible: an ASGI app (Starlette) over the engine.

Routes: POST /v1/chat/completions (the chat template applied explicitly; `chat_template` picks
another or "none"), POST /v1/completions (the raw prompt, as `generate --no-template`), GET
/v1/models, GET /health, GET /props (the template's name and source), POST /tokenize and /detokenize
(llama-server's), and the chat page at `/`. Streaming is server-sent events. `return_prompt: true`
adds the rendered prompt and its token ids to a response.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..batching import Request, TokenLogprob
from ..chat_template import builtin_template, builtin_template_names
from ..errors import MlxLlamaError
from ..generate import GenerationResult, check_fits
from ..prompt import NO_TEMPLATE, Prompt, Template, build_prompt, choose_template, messages_for
from ..sampling import SamplingParams
from ..speculative import Drafting
from ..tool_calls import ToolCallStream, ToolUse, tool_use
from .engine import Engine, Finished, Overloaded, Ticket, TooLarge
from .engine_process import EngineProcess
from .protocol import ApiError, Settings, read_anthropic, read_messages, read_prompt, read_settings


@dataclass
class ServerSettings:
    template: Template  # the server's chat template (--template, --template-file or the file's)
    params: SamplingParams  # the sampling defaults, as generate's options give them
    max_tokens: int
    api_key: str | None = None
    drafting: Drafting | None = None  # speculative decoding of every request, unless a request says otherwise


# The n-gram length a request's `prediction` is looked up by, unless it or the server says otherwise.
PREDICTION_NGRAM = 3

# The chat page (`/`): static files shipped in the package, talking only to the routes below.
WEBUI = Path(__file__).parent.parent / "webui"


def create_app(model, engine: Engine | EngineProcess, settings: ServerSettings, webui: bool = True) -> Starlette:
    """The app over `engine`, for `model`: a loaded Runtime, or a ModelFile (the file without its
    weights) where an EngineProcess holds the model. It reads the model's path, configuration,
    tokenizer and chat template, and asks the engine for the rest."""
    api = Api(model, engine, settings)
    page = [Route("/", lambda request: FileResponse(WEBUI / "index.html"), methods=["GET"]),
            Mount("/webui", StaticFiles(directory=WEBUI), name="webui")] if webui else []
    routes = page + [
        Route("/health", api.health, methods=["GET"]),
        Route("/props", api.props, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/messages", api.messages, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={Exception: api.unexpected})


class Api:
    def __init__(self, model, engine: Engine | EngineProcess, settings: ServerSettings):
        self.model, self.engine, self.settings = model, engine, settings
        self.model_id = os.path.basename(model.path)
        self._token_texts: dict[int, str] = {}
        self.created = int(time.time())

    # ---- the routes ----------------------------------------------------------------------------

    async def health(self, request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok", **await self.engine.health()})

    async def props(self, request: HttpRequest) -> Response:
        """What the chat page shows beside a reply: the model, its template's name and source, and
        the built-in templates a request may pick instead (with theirs)."""
        template = self.settings.template
        return await self._guarded(request, lambda body: JSONResponse({
            "model": self.model_id, "path": self.model.path, "context_length": self.model.config.context_length,
            "template": {"label": template.label, "source": template.text},
            "templates": {name: builtin_template(name) for name in builtin_template_names()}}), read=False)

    async def models(self, request: HttpRequest) -> Response:
        return await self._guarded(request, lambda body: JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "mlxllama"}]}), read=False)

    async def chat_completions(self, request: HttpRequest) -> Response:
        async def handle(body: dict) -> Response:
            settings = read_settings(body, self.settings.params, self.settings.max_tokens,
                                     {"messages", "tools", "tool_choice"})
            template = self._template(settings.template)
            use = self._tool_use(template, settings)
            variables = {**settings.template_kwargs, **(use.template_variables() if use else {})}
            prompt = self._chat_prompt(template, read_messages(body), variables)
            return await self._respond(prompt, settings, chat=True, tools=use)

        return await self._guarded(request, handle)

    async def completions(self, request: HttpRequest) -> Response:
        async def handle(body: dict) -> Response:
            settings = read_settings(body, self.settings.params, self.settings.max_tokens, {"prompt"})
            prompt = build_prompt(self.model.tokenizer, NO_TEMPLATE, messages_for(read_prompt(body)))
            return await self._respond(prompt, settings, chat=False)

        return await self._guarded(request, handle)

    async def messages(self, request: HttpRequest) -> Response:
        """Anthropic's Messages API: its fields read as the OpenAI ones they mean."""

        async def handle(body: dict) -> Response:
            messages, fields = read_anthropic(body)
            settings = read_settings(fields, self.settings.params, self.settings.max_tokens, set())
            return await self._respond(self._chat_prompt(self.settings.template, messages), settings, chat=None)

        return await self._guarded(request, handle, anthropic=True)

    async def tokenize(self, request: HttpRequest) -> Response:
        async def handle(body: dict) -> Response:
            content = body.get("content")
            if not isinstance(content, str):
                raise ApiError("'content' must be a string", "content")
            add_special, parse_special = body.get("add_special", False), body.get("parse_special", True)
            if not isinstance(add_special, bool) or not isinstance(parse_special, bool):
                raise ApiError("'add_special' and 'parse_special' must be true or false", "add_special")
            ids = self.model.tokenizer.encode(content, add_bos=add_special, special=parse_special)
            if body.get("with_pieces"):
                tokenizer = self.model.tokenizer
                return JSONResponse({"tokens": [{"id": i, "piece": tokenizer.id_to_piece(i)} for i in ids]})
            return JSONResponse({"tokens": ids})

        return await self._guarded(request, handle)

    async def detokenize(self, request: HttpRequest) -> Response:
        async def handle(body: dict) -> Response:
            tokens = body.get("tokens")
            vocab = self.model.tokenizer.vocab_size
            if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
                raise ApiError(f"'tokens' must be a list of token ids below {vocab}", "tokens")
            tokenizer = self.model.tokenizer
            if body.get("with_pieces"):  # each id's piece, and whether it is a control token
                return JSONResponse({"content": tokenizer.decode(tokens), "pieces": [
                    {"id": t, "piece": tokenizer.id_to_piece(t), "special": tokenizer.is_control(t)} for t in tokens]})
            return JSONResponse({"content": tokenizer.decode(tokens)})

        return await self._guarded(request, handle)

    async def unexpected(self, request: HttpRequest, error: Exception) -> Response:
        """A failure no check foresaw: a 500 for this request alone, with no traceback in it."""
        return JSONResponse(ApiError(f"internal error ({type(error).__name__})", status=500,
                                     kind="server_error").body(), status_code=500)

    # ---- shared ----------------------------------------------------------------------------------

    def token_text(self, token: int) -> str:
        """A token as text in log-probability listings: what it decodes to, or its name for a control token."""
        if token not in self._token_texts:
            tokenizer = self.model.tokenizer
            raw = tokenizer.token_bytes(token)
            self._token_texts[token] = raw.decode("utf-8", errors="replace") if raw else tokenizer.id_to_piece(token)
        return self._token_texts[token]

    async def _guarded(self, request: HttpRequest, handle, read: bool = True, anthropic: bool = False) -> Response:
        """Check the API key, read the JSON body, and answer an ApiError with its status and body
        (in Anthropic's shape for its API)."""
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
            body = {"type": "error", "error": {"type": e.kind, "message": e.message}} if anthropic else e.body()
            return JSONResponse(body, status_code=e.status, headers={"Retry-After": "1"} if e.status == 503 else None)

    def _authorize(self, request: HttpRequest) -> None:
        key = self.settings.api_key
        if key is None:
            return
        # OpenAI's clients send "Authorization: Bearer KEY", Anthropic's "x-api-key: KEY".
        given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
        given = given.strip()
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError("invalid or missing API key (Authorization: Bearer KEY)", status=401,
                           kind="authentication_error", code="invalid_api_key")

    def _chat_prompt(self, template: Template, messages: list[dict], template_kwargs: dict | None = None) -> Prompt:
        try:
            return build_prompt(self.model.tokenizer, template, messages, template_kwargs)
        except MlxLlamaError as e:
            raise ApiError(str(e), "messages") from None

    def _tool_use(self, template: Template, settings: Settings) -> ToolUse | None:
        """The request's tools, in the template's call format; a required call becomes the
        request's constraint (so it cannot also have a response_format)."""
        try:
            use = tool_use(template.text, template.label, settings.tools, settings.tool_choice)
        except MlxLlamaError as e:
            raise ApiError(str(e), "tool_choice" if "no tool named" in str(e) else "tools") from None
        if use is not None and use.choice != "auto":
            if settings.constraint is not None:
                raise ApiError("'response_format' cannot be combined with a required tool call", "response_format")
            try:
                settings.constraint = use.constraint(self.model.tokenizer)
                settings.constraint.check(self.model.tokenizer)
            except MlxLlamaError as e:
                raise ApiError(f"tools: {e}", "tools") from None
        return use

    def _template(self, name: str | None) -> Template:
        if name is None:
            return self.settings.template
        if name == "none":
            return NO_TEMPLATE
        try:
            return choose_template(self.model.chat_template, name)
        except MlxLlamaError as e:
            raise ApiError(str(e), "chat_template") from None

    def _drafting(self, settings: Settings) -> Drafting | None:
        """How the request is drafted for: the server's drafter (--draft-model or --lookup), or
        prompt lookup where it asks for it ("lookup"), over its "prediction" first where it gives
        one, with its own "draft_tokens"; none where it says "speculative": false or the server
        drafts for none and it asks for nothing."""
        default = self.settings.drafting
        if not settings.speculative or (default is None and settings.lookup is None and settings.prediction is None):
            if settings.draft_tokens is not None:
                raise ApiError("'draft_tokens' needs 'lookup', or a server started with --draft-model or --lookup",
                               "draft_tokens")
            return None
        if self.engine.sharded:
            raise ApiError("speculative decoding does not run under mlx.launch yet",
                           "lookup" if settings.lookup is not None else "speculative")
        k = settings.draft_tokens or (default.k if default is not None else Drafting.k)
        room = self.engine.budget.draft_room
        if self.engine.budget.max_kv_size and k > room:
            raise ApiError(f"'draft_tokens' must be at most {room} on a server with --max-kv-size", "draft_tokens")
        if settings.prediction is not None:
            reference = tuple(self.model.tokenizer.encode(settings.prediction, add_bos=False))
            n = settings.lookup or (default.lookup if default is not None and default.lookup else PREDICTION_NGRAM)
            return Drafting(k, lookup=n, reference=reference)
        if settings.lookup is not None:
            return Drafting(k, lookup=settings.lookup)
        return replace(default, k=k)

    async def _respond(self, prompt: Prompt, settings: Settings, chat: bool | None,
                       tools: ToolUse | None = None) -> Response:
        """The answer to a prompt: OpenAI's chat (chat True) or text completion (False), or Anthropic's message (None)."""
        vocab = self.model.tokenizer.vocab_size
        if any(token >= vocab for token, _ in settings.params.logit_bias):
            raise ApiError(f"'logit_bias' names a token id outside the vocabulary of {vocab}", "logit_bias")
        if settings.constraint is not None and tools is None:
            try:
                settings.constraint.check(self.model.tokenizer)
            except MlxLlamaError as e:
                raise ApiError(f"response_format: {e}", "response_format") from None
        try:
            check_fits(len(prompt.ids), self.engine.context)
        except MlxLlamaError as e:
            raise ApiError(str(e), "prompt" if chat is False else "messages", code="context_length_exceeded") from None
        request = Request(prompt.ids, settings.max_tokens, settings.params, settings.stop, settings.logprobs,
                          prompt_logprobs=settings.echo and settings.logprobs is not None,
                          constraint=settings.constraint, drafting=self._drafting(settings))
        completion = OpenAICompletion(self, prompt, settings, chat, tools) if chat is not None else AnthropicMessage(
            self, prompt, settings)
        try:
            events = completion.submit(request)
        except TooLarge as e:
            raise ApiError(str(e), "max_tokens") from None
        except Overloaded as e:
            raise ApiError(f"the server is busy: {e}; retry in a second", status=503, kind="server_overloaded",
                           code="overloaded") from None
        if settings.stream:
            return StreamingResponse(completion.stream(events), media_type="text/event-stream")
        return JSONResponse(await completion.whole(events))


class Completion:
    """One request's answer: the engine's events turned into a whole body or a stream, in the
    shapes of one API (OpenAICompletion, AnthropicMessage)."""

    def __init__(self, api: Api, prompt: Prompt, settings: Settings):
        self.api, self.prompt, self.settings = api, prompt, settings
        self.created = int(time.time())
        self.ticket: Ticket | None = None
        self.finished: Finished | None = None  # the engine's record of the request, once done

    def submit(self, request: Request) -> asyncio.Queue:
        """Hand the request to the engine; its events arrive on the returned queue:
        ("text", (piece, log-probabilities, ids)), then ("done", Finished) or ("error", exception)."""
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
                    self.finished = value
                    return self.whole_body(value.result, value)
        finally:
            self.ticket.cancel()  # a client that went away frees its row at the next step

    async def stream(self, events: asyncio.Queue) -> AsyncIterator[str]:
        try:
            for event in self.stream_start():
                yield event
            while True:
                kind, value = await events.get()
                if kind == "text":
                    if event := self.stream_text(*value):
                        yield event
                elif kind == "error":
                    yield self.stream_error(value)
                    return
                else:
                    self.finished = value
                    for event in self.stream_end(value.result, value):
                        yield event
                    return
        finally:
            self.ticket.cancel()

    def usage(self, result: GenerationResult) -> tuple[int, int]:
        return len(self.prompt.ids), len(result.token_ids)

    def prompt_extras(self, result: GenerationResult) -> dict:
        """return_prompt's addition: what the model was fed, the ids it answered with, and how many
        prompt tokens came from the prompt cache and how many the engine fed through the model."""
        if not self.settings.return_prompt:
            return {}
        return {"prompt": {"template": self.prompt.template, "text": self.prompt.text, "token_ids": self.prompt.ids,
                           "completion_token_ids": result.token_ids, "cached_tokens": self.finished.cached_tokens,
                           "prefilled_tokens": self.finished.prefilled_tokens}}

    def fingerprint(self) -> str:
        return f"mlxllama:{self.api.model_id}:{self.prompt.template}"


class OpenAICompletion(Completion):
    """/v1/chat/completions and /v1/completions: whole, or chunks as `data:` events ending in [DONE].

    A chat request with tools has its reply read for calls: they come as the message's
    `tool_calls` with finish_reason "tool_calls"; streamed, the text goes out until a call may
    start, and each call comes as one `tool_calls` delta at the end."""

    def __init__(self, api: Api, prompt: Prompt, settings: Settings, chat: bool, tools: ToolUse | None = None):
        super().__init__(api, prompt, settings)
        self.chat = chat
        self.tools = tools
        self.call_stream = ToolCallStream(tools, api.model.tokenizer) if tools else None
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"

    def whole_body(self, result: GenerationResult, finished: Finished) -> dict:
        logprobs = self._logprobs(finished.logprobs, finished.prompt_logprobs)
        content, calls = self.tools.read_reply(self.api.model.tokenizer, finished.ids) if self.tools else ("", [])
        if calls:
            message = {"role": "assistant", "content": content or None, "tool_calls": [c.as_openai() for c in calls]}
            choice = {"index": 0, "message": message, "finish_reason": "tool_calls", "logprobs": logprobs}
        elif self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "finish_reason": result.finish_reason, "logprobs": logprobs}
        else:
            text = (self.prompt.text if self.settings.echo else "") + result.text
            choice = {"index": 0, "text": text, "finish_reason": result.finish_reason, "logprobs": logprobs}
        return {**self._head(), "object": "chat.completion" if self.chat else "text_completion",
                "choices": [choice], "usage": self._usage(result), **self.prompt_extras(result)}

    def stream_start(self) -> list[str]:
        if self.chat:
            return [_data(self._chunk({"role": "assistant", "content": ""}))]
        return [_data(self._chunk(self.prompt.text))] if self.settings.echo else []

    def stream_text(self, piece: str, logprobs: list, ids: list[int]) -> str:
        if self.call_stream is not None:
            piece = self.call_stream.add(piece, ids)
        if not piece and not logprobs:
            return ""
        return _data(self._chunk({"content": piece} if self.chat else piece, logprobs=self._logprobs(logprobs, [])))

    def stream_error(self, error: BaseException) -> str:
        return _data(ApiError(f"generation failed ({type(error).__name__})", status=500, kind="server_error").body())

    def stream_end(self, result: GenerationResult, finished: Finished) -> list[str]:
        events, finish_reason = [], result.finish_reason
        if self.call_stream is not None:
            rest, calls = self.call_stream.finish(result.text, finished.ids)
            if rest:
                events.append(_data(self._chunk({"content": rest})))
            events += [_data(self._chunk({"tool_calls": [{"index": i, **call.as_openai()}]}))
                       for i, call in enumerate(calls)]
            finish_reason = "tool_calls" if calls else finish_reason
        events.append(_data(self._chunk({} if self.chat else "", finish_reason, self.prompt_extras(result))))
        if self.settings.include_usage:
            events.append(_data({**self._head(), "choices": [], "usage": self._usage(result)}))
        return events + ["data: [DONE]\n\n"]

    def _head(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.api.model_id, "system_fingerprint": self.fingerprint()}

    def _chunk(self, delta: dict | str, finish_reason: str | None = None, extras: dict | None = None,
               logprobs: dict | None = None) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {**self._head(), "choices": [choice], **(extras or {})}

    def _logprobs(self, generated: list[TokenLogprob], prompt: list[TokenLogprob]) -> dict | None:
        """OpenAI's logprobs object: chat's {"content": [...]}, or completions' parallel lists (the
        prompt's tokens first with echo, the first one without a log-probability)."""
        if self.settings.logprobs is None:
            return None
        text = self.api.token_text
        if self.chat:
            def entry(token: int, logprob: float) -> dict:
                piece = text(token)
                return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

            return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                                for t in generated]}
        scored: list[tuple[int, float | None, dict | None]] = []
        decode = self.api.model.tokenizer.decode
        offsets: list[int] = []
        if self.settings.echo:
            scored.append((self.prompt.ids[0], None, None))
            scored += [(t.token, t.logprob, {text(i): lp for i, lp in t.top}) for t in prompt]
            offsets = [len(decode(self.prompt.ids[:k])) for k in range(len(self.prompt.ids))]
        # Where each token's text starts in the response's text, as the decoded prefix before it.
        before = self.prompt.text if self.settings.echo else ""
        offsets += [len(before) + len(decode([t.token for t in generated[:k]]))
                    for k in range(len(generated))]
        scored += [(t.token, t.logprob, {text(i): lp for i, lp in t.top}) for t in generated]
        return {"tokens": [text(t) for t, _, _ in scored], "token_logprobs": [lp for _, lp, _ in scored],
                "top_logprobs": [top if self.settings.logprobs else None for _, _, top in scored],
                "text_offset": offsets}

    def _usage(self, result: GenerationResult) -> dict:
        prompt, completion = self.usage(result)
        # Speculative decoding's drafts, in the fields of OpenAI's Predicted Outputs (a prediction is a draft).
        speculation = {"completion_tokens_details": {"accepted_prediction_tokens": result.accepted,
                                                     "rejected_prediction_tokens": result.drafted - result.accepted}
                       } if self.finished is not None and self.finished.speculative else {}
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.finished.cached_tokens if self.finished else 0},
                **speculation}


class AnthropicMessage(Completion):
    """/v1/messages, Anthropic's Messages API: a message whole, or its named events
    (message_start, content_block_start, content_block_delta…, content_block_stop, message_delta,
    message_stop)."""

    def __init__(self, api: Api, prompt: Prompt, settings: Settings):
        super().__init__(api, prompt, settings)
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    def whole_body(self, result: GenerationResult, finished: Finished) -> dict:
        return {**self._message([{"type": "text", "text": result.text}], result), **self.prompt_extras(result)}

    def stream_start(self) -> list[str]:
        return [_named("message_start", {"type": "message_start", "message": self._message([], None)}),
                _named("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text", "text": ""}})]

    def stream_text(self, piece: str, logprobs: list, ids: list[int]) -> str:
        if not piece:
            return ""
        return _named("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": piece}})

    def stream_error(self, error: BaseException) -> str:
        return _named("error", {"type": "error", "error": {"type": "api_error",
                                                           "message": f"generation failed ({type(error).__name__})"}})

    def stream_end(self, result: GenerationResult, finished: Finished) -> list[str]:
        return [_named("content_block_stop", {"type": "content_block_stop", "index": 0}),
                _named("message_delta", {"type": "message_delta", "delta": self._stop(result),
                                         "usage": {"output_tokens": len(result.token_ids)}}),
                _named("message_stop", {"type": "message_stop"})]

    def _message(self, content: list, result: GenerationResult | None) -> dict:
        stop = self._stop(result) if result else {"stop_reason": None, "stop_sequence": None}
        prompt, completion = self.usage(result) if result else (len(self.prompt.ids), 0)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.api.model_id, "content": content,
                **stop, "usage": {"input_tokens": prompt, "output_tokens": completion}}

    @staticmethod
    def _stop(result: GenerationResult) -> dict:
        reason = "max_tokens" if result.finish_reason == "length" else "stop_sequence" if result.stop else "end_turn"
        return {"stop_reason": reason, "stop_sequence": result.stop}


def _data(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _named(event: str, payload: dict) -> str:
    return f"event: {event}\n{_data(payload)}"
