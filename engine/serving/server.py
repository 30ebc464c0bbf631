"""OpenAI-compatible HTTP server over the engine.

Data flow for a request:

    body bytes --protocol.*Request.model_validate_json--> request model      (400 on bad JSON/fields)
      -> model name check                                                     (404 model_not_found)
      -> prompt token ids (string via the tokenizer, chat via its template)  (400 too long / bad ids)
      -> SamplingParams, one per choice (n per prompt; seed + j for choice j) (400 naming the field)
      -> [echo with logprobs: the prompt's logprobs, on the engine thread]
      -> AsyncEngine.submit per choice -> RequestStream each                  (429 full, 503 dead)
      -> every first output awaited (so engine-side rejections are still 4xx/5xx)
      -> JSON response, or SSE `data: {...}` chunks (choices interleaved by index)
         ending with `data: [DONE]`

Client disconnects abort the request in the engine (streaming: the response
generator is closed; non-streaming: the handler polls `is_disconnected`).
`/health` is 200 while the engine loop runs, 503 otherwise; `/metrics` renders
this server's own Prometheus registry (see `metrics.py` for the names).

`build_app(async_engine, metrics, served_model_name)` is the app factory used by
tests in-process; `build_server(...)` also creates the engine, its
`ForwardPassManager`, and, when configured, the authenticated admin API
(`admin.mount_admin`, /admin/forward-passes; absent, hence 404, without an admin
token) and the rollout agent that follows the pod's annotations
(`rollout_agent.RolloutAgent`); `serve(...)` runs uvicorn (the `shapeshift serve`
command). Background services in `app.state.background_services` start after the
engine loop and stop before it.

Beside this module: `params.py` (request fields -> SamplingParams per choice),
`outputs.py` (engine outputs -> API shapes; several choices' streams merged),
`access.py` (--api-key, CORS), `structured.py` (response_format JSON), `tools.py` (tool
calls through it, or through `tool_parsers.py` for tool_choice "auto"), `preflight.py` (the CLI's checks before loading, the listening socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import traceback
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from shapeshift.engine.serving.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineStepError,
    RequestRejectedError,
    RequestStream,
)
from shapeshift.engine.provenance import package_version
from shapeshift.engine.serving.access import OPEN_PATHS, add_access_control
from shapeshift.engine.serving.metrics import EngineMetrics
from shapeshift.engine.serving.params import choice_params, sampling_params
from shapeshift.engine.serving.tool_parsers import get_parser
from shapeshift.engine.serving.tools import ToolPlan
from shapeshift.engine.serving.outputs import finish_reason, finite, logprob_at, merge, prepend, sse, top_at
from shapeshift.engine.serving.protocol import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    error_from_validation,
    new_id,
    now_unix,
)

logger = logging.getLogger("shapeshift.engine.serving.server")

DEFAULT_MAX_WAITING = 256
# A 429's Retry-After: a waiting line's worth of requests usually drains within a second or two.
RETRY_AFTER_SECONDS = 1
# Prompts longer than this (characters) are tokenized off the event loop so a
# 128K-token prompt does not stall every other connection.
TOKENIZE_OFF_LOOP_CHARS = 16_384


class _ClientDisconnected(Exception):
    pass


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=getattr(err, "headers", None))


class _Handlers:
    """Request handling bound to one engine; the FastAPI routes delegate here."""

    def __init__(self, async_engine: AsyncEngine, metrics: EngineMetrics, served_model_name: str,
                 tool_call_parser: str | None = None) -> None:
        self.async_engine = async_engine
        self.tool_parser = get_parser(tool_call_parser)
        self.engine = async_engine.engine
        self.metrics = metrics
        self.served_model_name = served_model_name
        self.max_model_len = int(self.engine.config.max_model_len)
        self.vocab_size = int(self.engine.model_config.vocab_size)
        self.created = now_unix()
        self._structured: Any = None  # structured.StructuredOutput, made on the first json response_format

    # ------------------------------------------------------------ parsing

    def parse(self, model_cls: type, raw: bytes) -> Any:
        try:
            req = model_cls.model_validate_json(raw)
        except ValidationError as exc:
            raise error_from_validation(exc) from None
        if req.model != self.served_model_name:
            raise APIError(404, f"The model '{req.model}' does not exist on this server; "
                                f"it serves '{self.served_model_name}' (see /v1/models).",
                           param="model", code="model_not_found")
        return req

    async def _off_loop_if_long(self, size: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if size > TOKENIZE_OFF_LOOP_CHARS:
            return await asyncio.to_thread(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    async def chat_prompt_ids(self, req: ChatCompletionRequest, plan: ToolPlan | None = None) -> list[int]:
        messages = [{"role": m.role, "content": m.text(), **m.model_dump(include={"tool_calls", "tool_call_id"},
                                                                         exclude_none=True)} for m in req.messages]
        size = sum(len(m["content"]) for m in messages)
        tok = self.engine.tokenizer
        try:
            text = await self._off_loop_if_long(
                size, tok.apply_chat_template, messages, add_generation_prompt=bool(req.add_generation_prompt),
                **({"tools": plan.tools} if plan is not None else {}))
        except Exception as exc:  # template errors (e.g. role order) are the client's to fix
            raise APIError(400, f"Invalid value for 'messages': the chat template rejected them: {exc}",
                           param="messages", code="invalid_value") from None
        # The template already spells out BOS and role markers.
        return list(await self._off_loop_if_long(size, tok.encode, text, add_special_tokens=False))

    def sampling_params(self, req: Any, prompt_len: int, max_tokens: int | None, max_tokens_param: str,
                        logprobs: bool, top_logprobs: int = 0) -> Any:
        return sampling_params(req, prompt_len, max_tokens, max_tokens_param, logprobs, top_logprobs,
                               max_model_len=self.max_model_len, vocab_size=self.vocab_size)

    def choice_params(self, params: Any, n: int) -> list[Any]:
        return choice_params(params, n)

    async def compile_response_format(self, rf: Any, tools: bool = False) -> Any:
        """The compiled grammar of a json response_format, or of a ToolPlan's calls with ``tools``
        (compiled off the event loop)."""
        from shapeshift.engine.serving import structured

        if not structured.available():
            raise APIError(400, ("tool calls need" if tools else f"response_format type {rf.type!r} needs") +
                           " constrained decoding, and xgrammar is not installed on this server; install it (pip "
                           "install xgrammar) and restart" + ("." if tools else ", or send {\"type\": \"text\"} and "
                                                                             "ask for JSON in the prompt."),
                           param="tool_choice" if tools else "response_format.type", code="unsupported_value")
        if self._structured is None:
            eos = sorted(self.engine.scheduler.eos_token_ids)
            self._structured = await asyncio.to_thread(structured.StructuredOutput, self.engine.tokenizer,
                                                       self.vocab_size, eos)
        schema = rf.format if rf.type == "structural_tag" else \
            rf.json_schema.schema_ if rf.json_schema is not None else None
        try:
            return await asyncio.to_thread(self._structured.compile, rf.type, schema, tools)
        except Exception as exc:  # xgrammar's schema errors are the client's to fix
            where = "tools' function.parameters" if tools else "response_format.format" \
                if rf.type == "structural_tag" else "response_format.json_schema.schema"
            raise APIError(400, f"Invalid value for '{where}': {exc}",
                           param="tools" if tools else where.rsplit(".schema", 1)[0], code="invalid_value") from None

    def log_inert(self, req: Any) -> None:
        fields = req.inert_fields_set()
        if fields:
            logger.debug("accepted without effect on the output: %s", ", ".join(fields))

    async def start_choices(self, request_id: str, prompts: list[tuple[list[int], Any]],
                            arrival: float) -> list[tuple[int, Any, RequestStream]]:
        """Submit every (prompt ids, params) as its own engine request and await each first
        output; on any failure the ones already submitted are aborted. Returns
        (choice index, first output, stream) in choice order."""
        streams: list[RequestStream] = []
        try:
            for i, (ids, params) in enumerate(prompts):
                streams.append(self.submit(request_id if len(prompts) == 1 else f"{request_id}-{i}",
                                           ids, params, arrival))
            firsts = [await self.first_output(s) for s in streams]
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return [(i, first, s) for i, (first, s) in enumerate(zip(firsts, streams))]

    def submit(self, request_id: str, prompt_ids: list[int], params: Any, arrival: float) -> RequestStream:
        try:
            return self.async_engine.submit(request_id, prompt_ids, params, arrival_time=arrival)
        except EngineOverloadedError as exc:
            self.metrics.count_request("rejected")
            err = APIError(429, str(exc), code="server_overloaded")
            err.headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
            raise err from None
        except EngineDeadError as exc:
            self.metrics.count_request("error")
            raise APIError(503, f"The engine is not running: {exc}", code="engine_unavailable") from None

    # ------------------------------------------------------------ streams

    @staticmethod
    def stream_error(exc: BaseException) -> APIError:
        if isinstance(exc, RequestRejectedError):
            param = exc.param or ("prompt" if "prompt" in str(exc).lower() else None)
            err = APIError(400, f"The engine rejected the request: {exc}", param=param, code="invalid_value")
            err.already_counted = True  # the engine loop counted it as `invalid`
            return err
        if isinstance(exc, EngineDeadError):
            return APIError(503, f"The engine is not running: {exc}", code="engine_unavailable")
        if isinstance(exc, EngineStepError):
            return APIError(500, f"The engine failed while serving this request: {exc}. "
                                 "Other requests are unaffected; retry.", code="engine_error")
        return APIError(500, f"Internal error: {exc!r}", code="internal_error")

    async def first_output(self, stream: RequestStream) -> Any:
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "The request ended before producing any output.", code="engine_error") from None
        except (RequestRejectedError, EngineDeadError, EngineStepError) as exc:
            raise self.stream_error(exc) from None
        except BaseException:
            stream.abort()
            raise

    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def top_dict(self, top: list[tuple[int, float]]) -> dict[str, float]:
        # Two ids may decode to one string; the more likely one (listed first) is kept.
        out: dict[str, float] = {}
        for tid, lp in top:
            out.setdefault(self.token_text(tid), finite(lp))
        return out

    async def prompt_logprobs(self, prompt_ids: list[int], top_n: int) -> list[Any]:
        try:
            return await self.async_engine.call(lambda engine: engine.prompt_logprobs(prompt_ids, top_n))
        except ValueError as exc:
            raise APIError(503 if "retry" in str(exc) else 400, str(exc), param="echo",
                           code="prompt_logprobs_unavailable") from None
        except EngineDeadError as exc:
            raise APIError(503, f"The engine is not running: {exc}", code="engine_unavailable") from None

    async def sse_events(self, started: list[tuple[int, Any, RequestStream]], prompt_tokens: int,
                         include_usage: bool, continuous_usage: bool, envelope: Callable[..., Any],
                         choice: Callable[[int, Any], Any], heads: list[Any] | None = None) -> AsyncIterator[str]:
        """The SSE body of one streaming request (completions and chat alike).

        ``envelope(choices, usage=None)`` wraps choices in the endpoint's chunk model and
        ``choice(index, out)`` makes one output's choice (or a list of them, one frame each). Frames: ``heads`` (first choices,
        if given), one per output that carries text, tokens or the finish (the choices'
        streams interleaved as they produce), usage on each of them with
        continuous_usage_stats, the usage chunk when the client asked for it, an error body
        if the request fails midway, and always ``[DONE]`` last. Every choice's request is
        aborted in the engine when the client goes away (the generator is closed) or once
        it ends.
        """
        completion_tokens = [0] * len(started)
        try:
            for head in heads or []:
                yield sse(envelope([head]).model_dump(exclude_none=True))
            async for index, out in merge(started):
                if not out.text_delta and not out.finished and not out.new_token_ids:
                    continue
                completion_tokens[index] += len(out.new_token_ids)
                usage = UsageInfo.of(prompt_tokens, sum(completion_tokens)) if continuous_usage else None
                made = choice(index, out)
                for one in made if isinstance(made, list) else [made]:
                    yield sse(envelope([one], usage).model_dump(exclude_none=True))
            if include_usage:
                yield sse(envelope([], UsageInfo.of(prompt_tokens, sum(completion_tokens))).model_dump(
                    exclude_none=True))
        except (RequestRejectedError, EngineDeadError, EngineStepError) as exc:
            yield sse(self.stream_error(exc).body())
        finally:
            for _, _, stream in started:
                stream.abort()
        yield "data: [DONE]\n\n"

    async def collect_all(self, started: list[tuple[int, Any, RequestStream]], request: Request) -> list[list[Any]]:
        """Every choice's outputs of a non-streaming request; aborts them all if the client goes away.

        A watcher task waits on the ASGI receive channel, which (the body being
        read) only yields `http.disconnect` when the client closes the connection.
        """
        disconnected = asyncio.Event()

        async def watch_disconnect() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    for _, _, stream in started:
                        stream.abort()  # delivers the end of each stream to its collector
                    return

        async def collect(first: Any, stream: RequestStream) -> list[Any]:
            return [out async for out in prepend(first, stream)]

        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            results = list(await asyncio.gather(*(collect(first, s) for _, first, s in started)))
        except (RequestRejectedError, EngineDeadError, EngineStepError) as exc:
            raise self.stream_error(exc) from None
        finally:
            watcher.cancel()
            for _, _, stream in started:
                stream.abort()  # no-op once finished; covers cancellation of this handler
        if disconnected.is_set() and not all(outs[-1].finished for outs in results):
            raise _ClientDisconnected()
        return results

    # ------------------------------------------------------------ handlers

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: CompletionRequest = self.parse(CompletionRequest, await request.body())
        req.check_together()
        self.log_inert(req)
        n = req.n or 1
        prompts = req.prompts()
        prompt_ids = [await self.prompt_token_ids(p, i, len(prompts)) for i, p in enumerate(prompts)]
        want_logprobs = req.logprobs is not None
        top_n = req.logprobs or 0
        per_choice = []
        for ids in prompt_ids:
            params = self.sampling_params(req, len(ids), req.max_tokens, "max_tokens", want_logprobs, top_n)
            per_choice += [(ids, p) for p in self.choice_params(params, n)]
        echo = bool(req.echo)
        # Echo: the prompt's text (and its logprobs) ahead of each choice's completion.
        echoed: list[tuple[str, CompletionLogprobs | None]] = []
        if echo:
            for p, ids in zip(prompts, prompt_ids):
                text = p if isinstance(p, str) else self.engine.tokenizer.decode(ids)
                lp = None
                if want_logprobs:
                    lp = CompletionLogprobs(top_logprobs=[] if top_n else None)
                    offset = 0
                    for tid, entry in zip(ids, await self.prompt_logprobs(ids, top_n)):
                        tok = self.token_text(tid)
                        lp.tokens.append(tok)
                        lp.token_logprobs.append(None if entry is None else finite(entry[0]))
                        if top_n:
                            lp.top_logprobs.append(None if entry is None else self.top_dict(entry[1]))
                        lp.text_offset.append(offset)
                        offset += len(tok)
                echoed.append((text, lp))
        request_id = new_id("cmpl")
        started = await self.start_choices(request_id, per_choice, arrival)
        created = now_unix()
        prompt_tokens = sum(len(ids) for ids in prompt_ids)

        def choice_parts(outs: list[Any], text_offset_start: int,
                         lp: CompletionLogprobs | None = None) -> tuple[str, list[int], CompletionLogprobs | None]:
            text = "".join(o.text_delta for o in outs)
            token_ids = [t for o in outs for t in o.new_token_ids]
            if want_logprobs:
                lp = lp or CompletionLogprobs(top_logprobs=[] if top_n else None)
                offset = text_offset_start
                for o in outs:
                    for i, tid in enumerate(o.new_token_ids):
                        tok = self.token_text(tid)
                        lp.tokens.append(tok)
                        lp.token_logprobs.append(logprob_at(o, i))
                        if top_n:
                            lp.top_logprobs.append(self.top_dict(top_at(o, i)))
                        lp.text_offset.append(offset)
                        offset += len(tok)
            return text, token_ids, lp

        def echo_of(index: int) -> tuple[str, CompletionLogprobs | None]:
            if not echo:
                return "", None
            text, lp = echoed[index // n]
            return text, None if lp is None else lp.model_copy(deep=True)

        if not req.stream:
            choices = []
            completion_tokens = 0
            for (index, _, _), outs in zip(started, await self.collect_all(started, request)):
                prefix, prefix_lp = echo_of(index)
                text, token_ids, lp = choice_parts(outs, len(prefix), prefix_lp)
                completion_tokens += len(outs[-1].output_token_ids)
                choices.append(CompletionChoice(index=index, text=prefix + text, finish_reason=finish_reason(outs[-1]),
                                                logprobs=lp, token_ids=token_ids if req.return_token_ids else None))
            body = CompletionResponse(id=request_id, created=created, model=self.served_model_name, choices=choices,
                                      usage=UsageInfo.of(prompt_tokens, completion_tokens))
            return JSONResponse(body.model_dump(exclude_none=True))

        offsets = [0] * len(started)  # characters streamed so far per choice (logprobs' text_offset)
        echo_pending = [echo] * len(started)

        def choice(index: int, out: Any) -> CompletionChoice:
            prefix, prefix_lp = echo_of(index) if echo_pending[index] else ("", None)
            echo_pending[index] = False
            text, token_ids, lp = choice_parts([out], offsets[index] + len(prefix), prefix_lp)
            offsets[index] += len(prefix) + len(text)
            return CompletionChoice(index=index, text=prefix + text, finish_reason=finish_reason(out), logprobs=lp,
                                    token_ids=token_ids if req.return_token_ids else None)

        def envelope(choices: list[Any], usage: UsageInfo | None = None) -> CompletionResponse:
            return CompletionResponse(id=request_id, created=created, model=self.served_model_name,
                                      choices=choices, usage=usage)

        return StreamingResponse(self.sse_events(started, prompt_tokens, req.include_usage_in_stream(),
                                                 req.continuous_usage(), envelope, choice),
                                 media_type="text/event-stream")

    async def prompt_token_ids(self, prompt: str | list[int], index: int, count: int) -> list[int]:
        if isinstance(prompt, str):
            return list(await self._off_loop_if_long(
                len(prompt), self.engine.tokenizer.encode, prompt, add_special_tokens=True))
        bad = [t for t in prompt if t >= self.vocab_size]
        if bad:
            where = f" (prompt {index})" if count > 1 else ""
            raise APIError(400, f"Invalid value for 'prompt'{where}: token id {bad[0]} is outside the "
                                f"vocabulary (size {self.vocab_size}).", param="prompt", code="invalid_value")
        return list(prompt)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: ChatCompletionRequest = self.parse(ChatCompletionRequest, await request.body())
        req.check_together()
        self.log_inert(req)
        plan = ToolPlan.of(req, self.tool_parser)
        prompt_ids = await self.chat_prompt_ids(req, plan)
        want_logprobs = bool(req.logprobs)
        top_n = req.top_logprobs or 0
        params = self.sampling_params(req, len(prompt_ids), req.requested_max_tokens(),
                                      req.max_tokens_param(), want_logprobs, top_n)
        per_choice = self.choice_params(params, req.n or 1)
        rf = req.response_format if plan is None else plan.response_format
        if rf is not None and rf.constrained():
            compiled = await self.compile_response_format(rf, tools=plan is not None and plan.constrains)
            for p in per_choice:
                p.constraint = self._structured.constraint(compiled)  # one grammar state per choice
        request_id = new_id("chatcmpl")
        started = await self.start_choices(request_id, [(prompt_ids, p) for p in per_choice], arrival)
        created = now_unix()

        def logprobs_of(outs: list[Any]) -> ChatLogprobs | None:
            if not want_logprobs:
                return None
            content = []
            for o in outs:
                for i, tid in enumerate(o.new_token_ids):
                    tok = self.token_text(tid)
                    top = [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
                           for t, lp in self.top_dict(top_at(o, i)).items()] if top_n else []
                    content.append(ChatTokenLogprob(token=tok, logprob=logprob_at(o, i),
                                                    bytes=list(tok.encode("utf-8")), top_logprobs=top))
            return ChatLogprobs(content=content)

        if not req.stream:
            choices = []
            completion_tokens = 0
            for (index, _, _), outs in zip(started, await self.collect_all(started, request)):
                token_ids = [t for o in outs for t in o.new_token_ids]
                completion_tokens += len(outs[-1].output_token_ids)
                text, finish = "".join(o.text_delta for o in outs), finish_reason(outs[-1])
                message, finish = (ChatResponseMessage(content=text), finish) if plan is None else plan.reply(text, finish)
                choices.append(ChatChoice(
                    index=index, message=message, finish_reason=finish, logprobs=logprobs_of(outs),
                    token_ids=token_ids if req.return_token_ids else None))
            body = ChatCompletionResponse(id=request_id, created=created, model=self.served_model_name,
                                          choices=choices, usage=UsageInfo.of(len(prompt_ids), completion_tokens))
            return JSONResponse(body.model_dump(exclude_none=True))

        def choice(index: int, out: Any) -> ChatChunkChoice | list[ChatChunkChoice]:
            delta, finish = (ChatDelta(content=out.text_delta), finish_reason(out)) if plan is None else \
                plan.stream_delta(index, out.text_delta, finish_reason(out))
            made = ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs_of([out]),
                                   token_ids=list(out.new_token_ids) if req.return_token_ids else None)
            if delta.tool_calls and finish is not None:
                # As OpenAI streams them: the calls, then the finish reason in a chunk of its own (the
                # openai client's stream helper closes a call's arguments on that chunk).
                made.finish_reason = None
                return [made, ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=finish)]
            return made

        def envelope(choices: list[Any], usage: UsageInfo | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=self.served_model_name,
                                       choices=choices, usage=usage)

        heads = [ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content="")) for index, _, _ in started]
        return StreamingResponse(self.sse_events(started, len(prompt_ids), req.include_usage_in_stream(),
                                                 req.continuous_usage(), envelope, choice, heads=heads),
                                 media_type="text/event-stream")

    async def tokenize(self, request: Request) -> dict[str, Any]:
        req: TokenizeRequest = self.parse(TokenizeRequest, await request.body())
        req.check_together()
        if req.messages is not None:
            ids = await self.chat_prompt_ids(req)
        else:
            ids = list(await self._off_loop_if_long(len(req.prompt), self.engine.tokenizer.encode, req.prompt,
                                                    add_special_tokens=bool(req.add_special_tokens)))
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.max_model_len).model_dump()

    async def detokenize(self, request: Request) -> dict[str, Any]:
        req: DetokenizeRequest = self.parse(DetokenizeRequest, await request.body())
        bad = [t for t in req.tokens if t >= self.vocab_size]
        if bad:
            raise APIError(400, f"Invalid value for 'tokens': token id {bad[0]} is outside the vocabulary "
                                f"(size {self.vocab_size}).", param="tokens", code="invalid_value")
        return DetokenizeResponse(prompt=self.engine.tokenizer.decode(req.tokens)).model_dump()

    def models(self) -> dict[str, Any]:
        card = ModelCard(id=self.served_model_name, created=self.created, max_model_len=self.max_model_len)
        return ModelList(data=[card]).model_dump()


def build_app(async_engine: AsyncEngine, metrics: EngineMetrics, served_model_name: str, *,
              api_key: str | None = None, cors_allow_origins: Sequence[str] = (),
              tool_call_parser: str | None = None) -> FastAPI:
    """The FastAPI app over a started (or to-be-started) `AsyncEngine`; its lifespan starts
    and stops the engine loop. ``api_key``: every route but OPEN_PATHS and the admin API
    needs `Authorization: Bearer <api_key>` (compared in constant time). ``cors_allow_origins``:
    browser origins allowed to call the API (`*` for any). ``tool_call_parser``: a name in
    tool_parsers.PARSERS, for tool_choice "auto" (None: "auto" with tools is a 400)."""
    handlers = _Handlers(async_engine, metrics, served_model_name, tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        services = list(app.state.background_services)
        for service in services:
            service.start()
        try:
            yield
        finally:
            for service in reversed(services):
                await asyncio.to_thread(service.stop)
            await asyncio.to_thread(async_engine.stop)

    app = FastAPI(title="Shapeshift engine", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.handlers = handlers
    app.state.background_services = []  # objects with start()/stop(), run alongside the engine loop

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status_code < 500 and exc.status_code != 429 and not getattr(exc, "already_counted", False):
            metrics.count_request("invalid")
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = f"{exc.detail}: {request.method} {request.url.path}"
        return _error_response(APIError(exc.status_code, msg, code=str(exc.status_code)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s:\n%s", request.url.path, traceback.format_exc())
        return _error_response(APIError(500, f"Internal error: {exc!r}", code="internal_error"))

    add_access_control(app, api_key, cors_allow_origins)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            return await handlers.completions(request)
        except _ClientDisconnected:
            return Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            return await handlers.chat_completions(request)
        except _ClientDisconnected:
            return Response(status_code=499)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return handlers.models()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        return await handlers.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        return await handlers.detokenize(request)

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": package_version(), "model": served_model_name}

    @app.get("/health")
    async def health() -> Response:
        healthy, reason = async_engine.is_healthy()
        if healthy:
            return JSONResponse({"status": "ok"})
        return _error_response(APIError(503, f"Engine unhealthy: {reason}", code="engine_unavailable"))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app


def build_server(config: Any, *, served_model_name: str | None = None,
                 max_waiting: int = DEFAULT_MAX_WAITING, admin_token_file: str | None = None,
                 admin_token_from_env: bool = False, rollout: Any = None, api_key: str | None = None,
                 cors_allow_origins: Sequence[str] = (), metrics_compat: str | None = None,
                 tool_call_parser: str | None = None) -> tuple[FastAPI, AsyncEngine]:
    """Load the engine for `config` (an `EngineConfig`) and wrap it in an app.

    `api_key`, `cors_allow_origins`: see `build_app`. `metrics_compat`: "vllm" adds the
    vLLM-named series to /metrics (`metrics.EngineMetrics`). `tool_call_parser`: see `build_app`.

    Admin API: mounted when `admin_token_file` is given, or `admin_token_from_env`
    (token from $SHAPESHIFT_ADMIN_TOKEN_FILE or $SHAPESHIFT_ADMIN_TOKEN); a missing or
    empty token raises ValueError. `rollout`: a `rollout_agent.RolloutSettings` to
    follow a pod's desired forward pass.
    """
    from shapeshift.engine.forward_pass.swap import ForwardPassManager
    from shapeshift.engine.core.llm_engine import LLMEngine

    engine = LLMEngine(config)
    name = served_model_name or getattr(engine, "model_name", None) or str(config.model)
    metrics = EngineMetrics(name, metrics_compat=metrics_compat)
    async_engine = AsyncEngine(engine, max_waiting=max_waiting, metrics=metrics)
    app = build_app(async_engine, metrics, name, api_key=api_key, cors_allow_origins=cors_allow_origins,
                    tool_call_parser=tool_call_parser)
    if api_key is not None:
        logger.info("API key required on every route but %s (and /admin, which has its own token)",
                    ", ".join(OPEN_PATHS))
    # One manager for the admin API and the rollout agent, so both see one history.
    manager = ForwardPassManager(engine)
    app.state.forward_pass_manager = manager
    admin = admin_token_file is not None or admin_token_from_env
    if admin:
        from shapeshift.engine.serving.admin import mount_admin

        mount_admin(app, async_engine, admin_token_file, manager=manager)
        logger.info("admin API enabled at /admin/forward-passes (token from %s)",
                    admin_token_file or "the environment")
    if rollout is not None:
        from shapeshift.engine.rollout.agent import RolloutAgent

        agent = RolloutAgent(async_engine, manager, metrics, rollout)
        app.state.rollout_agent = agent
        app.state.background_services.append(agent)
    if not admin and rollout is None:
        logger.warning("hot reload is disabled: no admin token (--admin-token-file, $SHAPESHIFT_ADMIN_TOKEN_FILE "
                       "or $SHAPESHIFT_ADMIN_TOKEN) and no --desired-forward-pass-file; /admin routes are absent")
    elif not admin:
        logger.warning("admin API disabled (no admin token); forward passes follow %s only",
                       rollout.annotations_file)
    return app, async_engine


def serve(config: Any, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          max_waiting: int = DEFAULT_MAX_WAITING, log_level: str = "info", admin_token_file: str | None = None,
          admin_token_from_env: bool = False, rollout: Any = None, api_key: str | None = None,
          cors_allow_origins: Sequence[str] = (), metrics_compat: str | None = None,
          tool_call_parser: str | None = None, sock: socket.socket | None = None) -> None:
    """Run the server until interrupted (blocking). ``sock``: a socket from `preflight.bind_socket`
    (bound here when not given, before the model loads)."""
    import uvicorn

    from shapeshift.engine.serving.preflight import bind_socket

    sock = sock or bind_socket(host, port)
    app, async_engine = build_server(config, served_model_name=served_model_name, max_waiting=max_waiting,
                                     admin_token_file=admin_token_file, admin_token_from_env=admin_token_from_env,
                                     rollout=rollout, api_key=api_key, cors_allow_origins=cors_allow_origins,
                                     metrics_compat=metrics_compat, tool_call_parser=tool_call_parser)
    logger.info("serving %s on http://%s:%d", app.state.handlers.served_model_name, host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
