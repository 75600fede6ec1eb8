"""The OpenAI-compatible HTTP server: `krait serve MODEL`.

`build_app(engine, served_model_names, api_key)` makes the FastAPI app around an AsyncLLMEngine;
`run_server(args)` builds the engine from `args.engine_config` and serves it with uvicorn.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from krait.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineStepError,
    RequestStream,
)
from krait.outputs import CompletionOutput, Logprob, RequestOutput
from krait.sampling_params import SamplingParams
from krait.server.cli_args import add_cli_args  # noqa: F401  (the options; kept here by name)
from krait.server.metrics import ServerMetrics
from krait.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    ToolCall,
    TopLogprob,
    UsageInfo,
    random_id,
)
from krait.server.tool_calls import (
    ParsedCall,
    ToolCallStream,
    ToolParser,
    get_tool_parser,
    named_choice,
    parse_calls,
    tool_choice_constraint,
)

logger = logging.getLogger(__name__)

MIN_LOGPROB = -9999.0  # JSON has no -inf
_STATUS_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                 405: "MethodNotAllowedError", 500: "InternalServerError",
                 503: "ServiceUnavailableError"}
_KNOWN_PARAMS = (set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
                 | {"prompt_token_ids"})


_M = TypeVar("_M", bound=BaseModel)


class ModelNotFoundError(Exception):
    """The request names a model this server does not serve."""


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    err = ErrorInfo(message=message, type=_STATUS_TYPES.get(status, "APIError"), param=param,
                    code=status)
    return JSONResponse(ErrorResponse(error=err).model_dump(), status_code=status)


def _param_of(message: str) -> str | None:
    """The request field a ValueError's message starts with, if any (the engine names it)."""
    first = message.split(" ", 1)[0].rstrip(":,")
    if first not in _KNOWN_PARAMS:
        first = first.split(".", 1)[0]
    return first if first in _KNOWN_PARAMS else None


async def parse_body(raw: Request, model: type[_M]) -> _M:
    """The JSON body as `model`, whatever the Content-Type; invalid JSON or fields raise
    RequestValidationError (answered with 400)."""
    try:
        return model.model_validate_json(await raw.body())
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


# ---------------------------------------------------------------- app state


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    served_model_names: list[str]
    max_model_len: int
    vocab_size: int
    tool_parser: ToolParser | None = None  # --tool-call-parser
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; raises ModelNotFoundError for a model not served here."""
        if requested is None or requested in self.served_model_names:
            return requested or self.served_model_names[0]
        raise ModelNotFoundError(f"The model `{requested}` does not exist.")

    def need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"{what}: this model has no tokenizer")
        return self.tokenizer

    def render_chat(self, messages: list, add_generation_prompt: bool,
                    kwargs: dict | None, tools: list | None = None) -> list[int]:
        """Token ids of the chat template applied to `messages` (and `tools`, for templates
        that render them; special tokens come from the template)."""
        tok = self.need_tokenizer("messages")
        msgs = [m.for_template() for m in messages]
        if not getattr(tok, "chat_template", None):
            raise ValueError("messages: the model's tokenizer has no chat template")
        try:
            extra = dict(kwargs or {})
            if tools:
                extra["tools"] = tools
            text = tok.apply_chat_template(msgs, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **extra)
        except Exception as exc:
            raise ValueError(f"messages: cannot apply the chat template: {exc}") from exc
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def token_str(self, token_id: int, lp: Logprob | None = None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


# ---------------------------------------------------------------- engine plumbing


async def add_all(state: ServerState, base_id: str, prompts: list[str | dict],
                  params: SamplingParams) -> list[RequestStream]:
    """Add one engine request per prompt; if any is refused, abort those already added."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(await state.engine.add_request(rid, prompt, params))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) pairs of several streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Response],
                              streams: list[RequestStream]) -> Response:
    """Await `work`; if the client goes away first, abort its requests at once."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        logger.info("client disconnected; aborting %d request(s)", len(streams))
        task.cancel()
        return Response(status_code=499)
    finally:
        watcher.cancel()
        for s in streams:
            s.close()


def usage_of(finals: dict[int, RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in finals.values())
    completion = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals.values())
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


# ---------------------------------------------------------------- logprobs


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    items = sorted(entry.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0,
                                                  -kv[1].logprob))
    return items[:k]


def completion_logprobs(state: ServerState, token_ids: list[int],
                        logprobs: list[dict[int, Logprob]], k: int,
                        text_offset: int) -> CompletionLogProbs:
    """OpenAI's legacy logprobs object; an echoed prompt's first token has `None` logprobs."""
    result = CompletionLogProbs()
    offset = text_offset
    for tid, entry in zip(token_ids, logprobs):
        sampled = entry.get(tid) if entry else None
        tok = state.token_str(tid, sampled)
        result.tokens.append(tok)
        result.text_offset.append(offset)
        offset += len(tok)
        if sampled is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(max(sampled.logprob, MIN_LOGPROB))
        top = {state.token_str(t, lp): max(lp.logprob, MIN_LOGPROB) for t, lp in _top(entry, k)}
        top.setdefault(tok, max(sampled.logprob, MIN_LOGPROB))
        result.top_logprobs.append(top)
    return result


def chat_logprobs(state: ServerState, token_ids: list[int],
                  logprobs: list[dict[int, Logprob]], k: int) -> ChatLogProbs:
    content = []
    for tid, entry in zip(token_ids, logprobs):
        sampled = entry.get(tid)
        tok = state.token_str(tid, sampled)
        top = []
        for t, lp in _top(entry, k):
            s = state.token_str(t, lp)
            top.append(TopLogprob(token=s, logprob=max(lp.logprob, MIN_LOGPROB),
                                  bytes=list(s.encode())))
        lp_value = sampled.logprob if sampled is not None else MIN_LOGPROB
        content.append(ChatTokenLogprob(token=tok, logprob=max(lp_value, MIN_LOGPROB),
                                        bytes=list(tok.encode()), top_logprobs=top))
    return ChatLogProbs(content=content)


# ---------------------------------------------------------------- completions


@dataclass
class _Delta:
    """Progress already sent for one choice of a stream."""

    text_len: int = 0
    num_tokens: int = 0
    started: bool = False
    done: bool = False


class CompletionBuilder:
    """Turns RequestOutputs into /v1/completions choices (whole or as stream deltas)."""

    def __init__(self, state: ServerState, req: CompletionRequest, prompts: list[str | dict]):
        self.state, self.req, self.prompts = state, req, prompts
        self.k = req.logprobs
        self.deltas: dict[tuple[int, int], _Delta] = {}

    def prompt_text(self, i: int, out: RequestOutput) -> str:
        p = self.prompts[i]
        if isinstance(p, str):
            return p
        if out.prompt is not None:
            return out.prompt
        tok = self.state.need_tokenizer("echo")
        return tok.decode(out.prompt_token_ids)

    def choice(self, i: int, out: RequestOutput, c: CompletionOutput,
               delta: _Delta | None) -> CompletionChoice | None:
        """The whole choice (delta None), or what is new since `delta`; None if nothing is."""
        start_text = delta.text_len if delta else 0
        start_tok = delta.num_tokens if delta else 0
        text = c.text[start_text:]
        token_ids = c.token_ids[start_tok:]
        echo = self.req.echo and (delta is None or not delta.started)
        if delta is not None:
            if not (text or token_ids or echo or (c.finish_reason and not delta.done)):
                return None
            delta.text_len, delta.num_tokens = len(c.text), len(c.token_ids)
            delta.started = True
            delta.done = c.finish_reason is not None
        logprobs = None
        prefix = self.prompt_text(i, out) if echo else ""
        if self.k is not None and c.logprobs is not None:
            ids: list[int] = []
            lps: list[dict[int, Logprob]] = []
            offset = start_text  # text_offset counts from the start of the echoed prompt
            if echo:
                ids = list(out.prompt_token_ids)
                lps = [e or {} for e in (out.prompt_logprobs or [None] * len(ids))]
            elif self.req.echo:
                offset += len(self.prompt_text(i, out))
            ids += token_ids
            lps += c.logprobs[start_tok:start_tok + len(token_ids)]
            logprobs = completion_logprobs(self.state, ids, lps, self.k, offset)
        return CompletionChoice(index=i * self.req.n + c.index, text=prefix + text,
                                logprobs=logprobs, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason)

    async def full(self, rid: str, model: str, streams: list[RequestStream]) -> Response:
        finals: dict[int, RequestOutput] = {}
        async for i, out in merge(streams):
            _raise_on_error(out)
            finals[i] = out
        choices = [self.choice(i, finals[i], c, None) for i in sorted(finals)
                   for c in finals[i].outputs]
        resp = CompletionResponse(id=rid, model=model, choices=choices, usage=usage_of(finals))
        return Response(resp.model_dump_json(), media_type="application/json")

    async def stream(self, rid: str, model: str,
                     streams: list[RequestStream]) -> AsyncIterator[str]:
        created = int(time.time())
        usage = self.req.include_usage
        exclude = None if usage else {"usage"}
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in merge(streams):
                _raise_on_error(out)
                finals[i] = out
                for c in out.outputs:
                    choice = self.choice(i, out, c, self.deltas.setdefault((i, c.index), _Delta()))
                    if choice is not None:
                        chunk = CompletionChunk(id=rid, created=created, model=model,
                                                choices=[choice])
                        if self.req.continuous_usage:
                            chunk.usage = usage_of(finals)
                        yield _sse(chunk.model_dump_json(exclude=exclude))
            if usage:
                chunk = CompletionChunk(id=rid, created=created, model=model, choices=[],
                                        usage=usage_of(finals))
                yield _sse(chunk.model_dump_json())
        except Exception as exc:  # the stream ends with an error event, never cut short
            yield _sse(_stream_error(exc))
        finally:
            for s in streams:
                s.close()
        yield "data: [DONE]\n\n"


def _stream_error(exc: Exception) -> str:
    if isinstance(exc, ValueError):  # the request's own fault (e.g. its grammar)
        err = ErrorInfo(message=str(exc), type="BadRequestError", code=400)
        return ErrorResponse(error=err).model_dump_json()
    if not isinstance(exc, (EngineStepError, EngineDeadError)):
        logger.exception("error while streaming a response", exc_info=exc)
    err = ErrorInfo(message=str(exc), type="InternalServerError", code=500)
    return ErrorResponse(error=err).model_dump_json()


def _raise_on_error(out: RequestOutput) -> None:
    """A choice that finished with an error (its grammar failed to compile) fails the request."""
    for c in out.outputs:
        if c.finish_reason == "error":
            raise ValueError(str(c.stop_reason or "the request failed"))


def _tool_calls(calls: list[ParsedCall]) -> list[ToolCall]:
    return [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]


# ---------------------------------------------------------------- chat


class ChatBuilder:
    """Turns RequestOutputs into /v1/chat/completions choices and chunks."""

    def __init__(self, state: ServerState, req: ChatCompletionRequest, parser: ToolParser | None,
                 forced: bool):
        self.state, self.req = state, req
        self.k = (req.top_logprobs or 0) if req.logprobs else None
        self.parser = parser  # tools with tool_choice "auto": the server's tool-call parser
        self.forced = forced  # tool_choice "required" or named: the output is the call(s)

    def _finish_reason(self, c: CompletionOutput, calls: list) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a named (forced) call is a "stop"
        if calls and c.finish_reason == "stop" and named_choice(self.req.tool_choice) is None:
            return "tool_calls"
        return c.finish_reason

    def logprobs(self, c: CompletionOutput, start: int) -> ChatLogProbs | None:
        if self.k is None or c.logprobs is None:
            return None
        return chat_logprobs(self.state, c.token_ids[start:], c.logprobs[start:], self.k)

    async def full(self, rid: str, model: str, streams: list[RequestStream]) -> Response:
        final = None
        async for _, out in merge(streams):
            _raise_on_error(out)
            final = out
        choices = []
        for c in final.outputs:
            content, calls = c.text, []
            if self.parser is not None or self.forced:
                content, calls = parse_calls(c.text, self.parser, self.req.tool_choice,
                                             self.forced)
            message = ChatResponseMessage(content=content, tool_calls=_tool_calls(calls))
            choices.append(ChatChoice(index=c.index, message=message,
                                      logprobs=self.logprobs(c, 0),
                                      finish_reason=self._finish_reason(c, calls),
                                      stop_reason=c.stop_reason))
        resp = ChatCompletionResponse(id=rid, model=model, choices=choices,
                                      usage=usage_of({0: final}))
        return Response(resp.model_dump_json(), media_type="application/json")

    async def stream(self, rid: str, model: str,
                     streams: list[RequestStream]) -> AsyncIterator[str]:
        created = int(time.time())
        usage = self.req.include_usage
        exclude = None if usage else {"usage"}
        final = None

        def chunk(choice: ChatStreamChoice) -> str:
            c = ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])
            if self.req.continuous_usage and final is not None:
                c.usage = usage_of({0: final})
            return _sse(c.model_dump_json(exclude=exclude))

        for index in range(self.req.n):
            yield chunk(ChatStreamChoice(index=index,
                                         delta=DeltaMessage(role="assistant", content="")))
        deltas: dict[int, _Delta] = {}
        tools: dict[int, ToolCallStream] = {}
        try:
            async for _, out in merge(streams):
                _raise_on_error(out)
                final = out
                for c in out.outputs:
                    d = deltas.setdefault(c.index, _Delta())
                    start = d.num_tokens
                    new_finish = c.finish_reason is not None and not d.done
                    if not (len(c.text) > d.text_len or len(c.token_ids) > start or new_finish):
                        continue
                    d.text_len, d.num_tokens, d.done = len(c.text), len(c.token_ids), new_finish
                    tc = tools.setdefault(c.index, ToolCallStream(
                        self.parser, self.req.tool_choice, self.forced))
                    text, calls = tc.finish(c.text) if new_finish else tc.feed(c.text)
                    delta = DeltaMessage(content=text, tool_calls=[
                        DeltaToolCall(index=j, id=call.id, type="function",
                                      function=DeltaFunctionCall(name=call.name,
                                                                 arguments=call.arguments))
                        for j, call in calls] or None)
                    reason = None
                    if new_finish:
                        reason = self._finish_reason(c, [None] * tc.num_calls)
                    yield chunk(ChatStreamChoice(
                        index=c.index, delta=delta, logprobs=self.logprobs(c, start),
                        finish_reason=reason, stop_reason=c.stop_reason))
            if usage and final is not None:
                c = ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                        usage=usage_of({0: final}))
                yield _sse(c.model_dump_json())
        except Exception as exc:  # the stream ends with an error event, never cut short
            yield _sse(_stream_error(exc))
        finally:
            for s in streams:
                s.close()
        yield "data: [DONE]\n\n"


# ---------------------------------------------------------------- the app


class EngineStreamResponse(StreamingResponse):
    """An SSE response that aborts its engine requests however the response ends (the client
    may leave before the body generator even starts)."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self.streams:
                s.close()


class ApiKeyMiddleware:
    """401 on /v1/* without `Authorization: Bearer <api_key>` (plain ASGI, so streaming and
    disconnect detection pass through untouched)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                resp = error_response(401, "Invalid or missing API key (Authorization: Bearer)")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLMEngine, served_model_names: list[str],
              api_key: str | None = None, metrics: ServerMetrics | None = None,
              tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False) -> FastAPI:
    """The FastAPI app serving `engine` under `served_model_names` (the first is the default);
    `tool_call_parser` (hermes, granite) reads tool calls when tool_choice is "auto"."""
    cfg = engine.config.model
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
    parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
    state = ServerState(engine, list(served_model_names), cfg.max_model_len, cfg.vocab_size,
                        parser, enable_auto_tool_choice)
    app = FastAPI(title="krait", docs_url=None, redoc_url=None)
    app.state.krait = state

    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        message = f"{param}: {msg}" if param else msg
        return error_response(400, message, param)

    @app.exception_handler(ValueError)
    async def on_value_error(_: Request, exc: ValueError):
        return error_response(400, str(exc), _param_of(str(exc)))

    @app.exception_handler(ModelNotFoundError)
    async def on_model_not_found(_: Request, exc: ModelNotFoundError):
        return error_response(404, str(exc), "model")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineStepError)
    async def on_step_error(_: Request, exc: EngineStepError):
        return error_response(500, str(exc))

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(_: Request, exc: EngineDeadError):
        return error_response(503, str(exc))

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception):
        logger.error("request failed", exc_info=exc)
        return error_response(500, f"{type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        if metrics is None:
            return Response(b"", media_type="text/plain")
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=cfg.model, max_model_len=state.max_model_len,
                                         vocab_size=state.vocab_size)
                               for name in state.served_model_names])

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        req = await parse_body(raw, CompletionRequest)
        model = state.model_name(req.model)
        params = req.to_sampling_params()
        params.validate(state.vocab_size)
        await _check_grammar(params, req.structured_field)
        prompts = req.prompts()
        if req.echo and state.tokenizer is None and any(isinstance(p, dict) for p in prompts):
            raise ValueError("echo: this model has no tokenizer to decode the prompt")
        rid = random_id("cmpl")
        streams = await add_all(state, rid, prompts, params)
        builder = CompletionBuilder(state, req, prompts)
        if req.stream:
            return EngineStreamResponse(builder.stream(rid, model, streams), streams)
        return await unless_disconnected(raw, builder.full(rid, model, streams), streams)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        req = await parse_body(raw, ChatCompletionRequest)
        model = state.model_name(req.model)
        params = req.to_sampling_params()
        parser, forced = _tool_mode(state, req, params)
        params.validate(state.vocab_size)
        await _check_grammar(params, "tool_choice" if forced else req.structured_field)
        ids = state.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                                req.tools or None)
        rid = random_id("chatcmpl")
        streams = await add_all(state, rid, [{"prompt_token_ids": ids}], params)
        builder = ChatBuilder(state, req, parser, forced)
        if req.stream:
            return EngineStreamResponse(builder.stream(rid, model, streams), streams)
        return await unless_disconnected(raw, builder.full(rid, model, streams), streams)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> TokenizeResponse:
        req = await parse_body(raw, TokenizeRequest)
        state.model_name(req.model)
        tok = state.need_tokenizer("prompt")
        if req.messages is not None:
            ids = state.render_chat(req.messages, req.add_generation_prompt, None)
            if req.add_special_tokens:
                ids = tok.build_inputs_with_special_tokens(ids)
        elif req.prompt is not None:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = list(tok(req.prompt, add_special_tokens=add_special)["input_ids"])
        else:
            raise ValueError("prompt or messages is required")
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids,
                                token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> DetokenizeResponse:
        req = await parse_body(raw, DetokenizeRequest)
        state.model_name(req.model)
        tok = state.need_tokenizer("tokens")
        bad = [t for t in req.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise ValueError(f"tokens holds {bad[0]}, outside the vocabulary [0, {state.vocab_size})")
        return DetokenizeResponse(prompt=tok.decode(req.tokens))

    return app


async def _check_grammar(params: SamplingParams, field: str) -> None:
    """A request's constraint checked off the event loop (the first one imports xgrammar):
    a bad schema, regex or grammar is a 400 naming the body `field` it came from, before the
    engine sees it."""
    if params.structured_outputs is None:
        return
    from krait.structured.grammar import validate_structured  # noqa: PLC0415

    try:
        await asyncio.to_thread(validate_structured, params.structured_outputs)
    except ValueError as e:
        msg = str(e)
        if msg.startswith("structured_outputs") and ": " in msg:
            msg = msg.split(": ", 1)[1]
        raise ValueError(f"{field}: {msg}") from e


def _tool_mode(state: ServerState, req: ChatCompletionRequest,
               params: SamplingParams) -> tuple[ToolParser | None, bool]:
    """(parser, forced) of a chat request: tool_choice "auto" parses the output with the
    server's parser; "required" or a named function constrains it (params gains the grammar)
    and reads the call(s) from it; "none" or no tools leave the output alone."""
    tools, choice = req.tools or None, req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice: needs tools")
        return None, False
    constraint = tool_choice_constraint(tools, choice, req.parallel_tool_calls)
    if constraint is not None:
        if params.structured_outputs is not None:
            raise ValueError("tool_choice: a required or named tool choice cannot be combined "
                             "with response_format or guided decoding")
        params.structured_outputs = constraint
        return None, True
    if choice == "none":
        return None, False
    if not state.enable_auto_tool_choice or state.tool_parser is None:
        raise ValueError('tool_choice: "auto" needs the server started with '
                         "--enable-auto-tool-choice --tool-call-parser NAME")
    return state.tool_parser, False


# ---------------------------------------------------------------- CLI entry


def run_server(args: argparse.Namespace) -> None:
    """Serve `args.engine_config` until interrupted."""
    import uvicorn

    from krait import envs

    config = args.engine_config
    names = list(getattr(args, "served_model_name", None) or [config.model.model])
    api_key = getattr(args, "api_key", None) or envs.get("KRAIT_API_KEY") or None
    parser = getattr(args, "tool_call_parser", None)
    if getattr(args, "enable_auto_tool_choice", False) and parser is None:
        raise SystemExit("krait serve: --enable-auto-tool-choice needs --tool-call-parser NAME")
    metrics = ServerMetrics(names[0])
    engine = AsyncLLMEngine.from_config(config, observer=metrics)
    app = build_app(engine, names, api_key=api_key, metrics=metrics,
                    tool_call_parser=getattr(args, "tool_call_parser", None),
                    enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False))
    try:
        uvicorn.run(app, host=getattr(args, "host", "127.0.0.1"),
                    port=getattr(args, "port", 8000), log_level="info",
                    timeout_keep_alive=30)
    finally:
        engine.shutdown()
