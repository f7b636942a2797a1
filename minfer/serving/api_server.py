"""An OpenAI-compatible HTTP server: `python -m minfer serve [MODEL] [--port 8000] [engine args]`.

    GET  /v1/models            the served model
    POST /v1/completions       text completion (stream: Server-Sent Events)
    POST /v1/chat/completions  chat, through the model's chat template
    GET  /health               200 while serving, 503 while shutting down
    GET  /metrics              Prometheus text (minfer/serving/metrics.py)

Any OpenAI client works against it, e.g. `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")`.
Every handler does the same three things: turn the body into prompts and `SamplingParams`, add
them to the async engine (minfer/serving/async_engine.py), and turn the outputs that arrive into
OpenAI's response, all at once or as a stream of deltas.

Bad input never gets a 500: a body the schema refuses (types are strict: true is not 1), or a
value the engine refuses (its ValueError), is a 400 in OpenAI's error format; an unknown model
name a 404. A client that goes away has its requests aborted, so their KV blocks return to the
pool within a step or two.

One client cannot hurt the others. Each request's work is bounded (`RequestLimits`: n, stop
strings, stop tokens; --max-request-tokens: the KV cache its sequences may hold); the waiting
queue has a bound that holds under bursts (--max-waiting-requests); a request's headers and
body must arrive within --request-read-timeout; idle connections close after
--timeout-keep-alive; past --limit-concurrency connections new requests get 503.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import sys
from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from minfer.config import add_engine_arguments, engine_kwargs_from_args
from minfer.llm import LLM
from minfer.outputs import RequestOutput
from minfer.serving import protocol as api
from minfer.serving.async_engine import AsyncEngine, QueueFull, RequestFailed, RequestGroup, ShuttingDown
from minfer.serving.metrics import ServerMetrics

MAX_BODY_BYTES = 4 * 2**20  # a request body larger than this gets 413 (about a million tokens of text)
REQUEST_READ_TIMEOUT_S = 30.0  # a request whose headers or body take longer gets cut off (408)
LIMIT_CONCURRENCY = 512  # connections and requests at once; past it, uvicorn answers 503


def build_app(llm: LLM, served_model_name: str, api_key: Optional[str] = None,
              max_waiting_requests: Optional[int] = None, max_body_bytes: int = MAX_BODY_BYTES,
              limits: api.RequestLimits = api.RequestLimits(), max_request_tokens: Optional[int] = None,
              request_read_timeout: float = REQUEST_READ_TIMEOUT_S) -> FastAPI:
    """The FastAPI app serving `llm` under `served_model_name` (the engine loop starts with the app).

    max_request_tokens: the most KV-cache tokens one request's sequences may hold (None: the whole pool)."""
    pool_tokens = llm.engine.blocks.num_blocks * llm.engine.blocks.block_size
    engine = AsyncEngine(llm, max_waiting_requests, max_request_tokens=max_request_tokens or pool_tokens)
    metrics = ServerMetrics(engine, served_model_name)
    engine.listener = metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="minfer", lifespan=lifespan)
    app.state.engine = engine
    app.add_middleware(Gate, api_key=api_key, max_body_bytes=max_body_bytes, read_timeout=request_read_timeout)
    _add_error_handlers(app)

    def check_model(name: Optional[str]) -> None:
        if name is not None and name != served_model_name:
            raise HTTPException(404, f"The model `{name}` does not exist: this server serves `{served_model_name}`")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.accepting else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": api.now(),
                                             "owned_by": "minfer", "root": served_model_name,
                                             "max_model_len": llm.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        limits.check(body)
        if body.suffix:
            raise ValueError("suffix is not supported by minfer")
        if body.echo and body.logprobs is not None:
            raise ValueError("echo together with logprobs is not supported by minfer: ask for one of them")
        group = await engine.add_requests(body.prompts(), body.sampling_params(body.max_tokens, body.logprobs),
                                          refuse_beyond_context=True)
        response_id, created, model = api.new_id("cmpl"), api.now(), served_model_name

        async def echo_text(output: RequestOutput) -> str:
            if not body.echo:
                return ""
            if output.prompt is not None:
                return output.prompt
            return await engine.run_on_engine_thread(llm.tokenizer.decode, output.prompt_token_ids)

        def choice(i: int, c, text: str, prefix: str = "", logprobs_from: int = 0, text_offset: int = 0) -> dict:
            logprobs = None if body.logprobs is None else api.completion_logprobs(c.logprobs, logprobs_from, text_offset)
            return {"index": i * body.n + c.index, "text": prefix + text, "logprobs": logprobs, **api.finish_fields(c)}

        if body.stream:
            async def events() -> AsyncIterator[str]:
                state, finals = api.StreamState(body.stop), {}
                async for i, output in engine.stream(group):
                    for c in output.outputs:
                        prefix = await echo_text(output) if state.first((i, c.index)) else ""
                        delta = state.delta((i, c.index), c)
                        if delta is None and not prefix:
                            continue
                        text, logprobs_from, text_offset = delta or ("", len(c.logprobs or []), 0)
                        yield _sse({"id": response_id, "object": "text_completion", "created": created, "model": model,
                                    "choices": [choice(i, c, text, prefix, logprobs_from, text_offset)]})
                    if output.finished:
                        finals[i] = output
                if body.include_usage:
                    yield _sse({"id": response_id, "object": "text_completion", "created": created, "model": model,
                                "choices": [], "usage": api.usage(list(finals.values()))})

            return _stream(events())

        finals = await _unless_disconnected(raw, _collect(engine, group))
        choices = [choice(i, c, c.text, await echo_text(o)) for i, o in enumerate(finals) for c in o.outputs]
        return JSONResponse({"id": response_id, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": api.usage(finals)})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: api.ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        limits.check(body)
        top_n = body.logprobs_count()
        params = body.sampling_params(body.token_limit(), top_n)
        prompt = await engine.run_on_engine_thread(llm.chat_prompt, body.conversation(), body.add_generation_prompt)
        group = await engine.add_requests([prompt], params, refuse_beyond_context=True)
        response_id, created, model = api.new_id("chatcmpl"), api.now(), served_model_name

        def logprobs(c, start: int = 0) -> Optional[dict]:
            return api.chat_logprobs(c.logprobs[start:], top_n) if top_n is not None else None

        if body.stream:
            async def events() -> AsyncIterator[str]:
                head = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model}
                state, final = api.StreamState(body.stop), None
                async for _, output in engine.stream(group):
                    for c in output.outputs:
                        if state.first((0, c.index)):  # OpenAI's first chunk of a choice names the role
                            yield _sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                             "logprobs": None, "finish_reason": None}]})
                        delta = state.delta((0, c.index), c)
                        if delta is None:
                            continue
                        text, logprobs_from, _ = delta
                        yield _sse({**head, "choices": [{"index": c.index, "delta": {"content": text} if text else {},
                                                         "logprobs": logprobs(c, logprobs_from), **api.finish_fields(c)}]})
                    final = output
                if body.include_usage:
                    yield _sse({**head, "choices": [], "usage": api.usage([final])})

            return _stream(events())

        (final,) = await _unless_disconnected(raw, _collect(engine, group))
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs(c),
                    **api.finish_fields(c)} for c in final.outputs]
        return JSONResponse({"id": response_id, "object": "chat.completion", "created": created, "model": model,
                             "choices": choices, "usage": api.usage([final])})

    return app


# ---------------------------------------------------------------- helpers of the handlers
async def _collect(engine: AsyncEngine, group: RequestGroup) -> list[RequestOutput]:
    """Every request's final output, in prompt order."""
    finals: dict[int, RequestOutput] = {}
    async for i, output in engine.stream(group):
        if output.finished:
            finals[i] = output
    return [finals[i] for i in range(len(group.request_ids))]


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


async def _unless_disconnected(raw: Request, work):
    """Await `work`, but give up (and so abort its requests) if the client disconnects meanwhile."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                return task.result()
            if await raw.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _stream(events: AsyncIterator[str]) -> StreamingResponse:
    """Server-Sent Events: the chunks, an error event if the engine fails mid-way, then [DONE]."""
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except RequestFailed as exc:  # the status line is already sent: report it in the stream, as vLLM does
            yield _sse(api.error_body(str(exc), "server_error", 500))
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _error(status: int, message: str, type_: str, headers: Optional[dict] = None, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(api.error_body(message, type_, status, param), status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems, param = [], None
        for e in exc.errors():
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            param = param or where or None
            problems.append(f"{where or 'body'}: {e.get('msg')}")
        return _error(400, "invalid request: " + "; ".join(problems), "BadRequestError", param=param)

    @app.exception_handler(ValueError)
    async def refused_value(request: Request, exc: ValueError) -> JSONResponse:
        return _error(400, str(exc), "BadRequestError")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowed"}.get(exc.status_code, "Error")
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, exc: QueueFull) -> JSONResponse:
        return _error(503, str(exc), "ServiceUnavailableError", headers={"Retry-After": "1"})

    @app.exception_handler(ShuttingDown)
    async def shutting_down(request: Request, exc: ShuttingDown) -> JSONResponse:
        return _error(503, str(exc), "ServiceUnavailableError")

    @app.exception_handler(ClientDisconnected)
    async def gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's code for it; nobody reads it

    @app.exception_handler(RequestFailed)
    async def failed(request: Request, exc: RequestFailed) -> JSONResponse:
        return _error(500, str(exc), "InternalServerError")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:  # a bug: still OpenAI's error shape
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "InternalServerError")


class Gate:
    """ASGI middleware in front of every route: the API key (on /v1/ only), the body's type, size and
    arrival time. The body is read here, whole, and handed on.

    (Plain ASGI rather than FastAPI's decorator middleware, which would buffer streamed
    responses and hide client disconnects from the handlers.)"""

    def __init__(self, app, api_key: Optional[str], max_body_bytes: int, read_timeout: float) -> None:
        self.app, self.api_key, self.max_body_bytes, self.read_timeout = app, api_key, max_body_bytes, read_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"].startswith("/v1/"):
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return await _send_error(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                         "AuthenticationError")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        content_type = headers.get(b"content-type", b"application/json").split(b";")[0].strip().lower()
        if content_type != b"application/json" and not content_type.endswith(b"+json"):
            return await _send_error(send, 415, f"the body is {content_type.decode('latin-1')!r}; this API takes JSON: "
                                     "send it with 'Content-Type: application/json'", "UnsupportedMediaType")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await _send_error(send, 413, f"the request body has {int(declared)} bytes; the limit is "
                                     f"{self.max_body_bytes}", "RequestTooLarge")
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.read_timeout
        while True:  # a client that stalls mid-body is cut off at the deadline
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                return await _send_error(send, 408, f"the request body did not arrive within {self.read_timeout:g} s",
                                         "RequestTimeout")
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await _send_error(send, 413, f"the request body is over the limit of {self.max_body_bytes} "
                                         "bytes", "RequestTooLarge")
            if not message.get("more_body"):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def _replay(body: bytes, receive):
    """A receive() that hands over an already-read body once, then listens as before (for disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


async def _send_error(send, status: int, message: str, type_: str) -> None:
    body = json.dumps(api.error_body(message, type_, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------- the command line
def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """`minfer serve`'s flags: the server's own, then every engine argument with vLLM's spelling."""
    parser.add_argument("model", nargs="?", default="smollm2-135m", help="model name, .gguf file or HF directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the name clients ask for (default: MODEL)")
    parser.add_argument("--api-key", default=os.environ.get("MINFER_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/ (default: $MINFER_API_KEY, else none)")
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="refuse new requests with 503 while this many wait for a place in the batch")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="larger request bodies get 413")
    defaults = api.RequestLimits()
    parser.add_argument("--max-n", type=int, default=defaults.max_n, help="the most completions per prompt (n)")
    parser.add_argument("--max-stop-strings", type=int, default=defaults.max_stop_strings,
                        help="the most stop strings in one request")
    parser.add_argument("--max-stop-string-chars", type=int, default=defaults.max_stop_string_chars,
                        help="the longest stop string, in characters")
    parser.add_argument("--max-stop-token-ids", type=int, default=defaults.max_stop_token_ids,
                        help="the most stop_token_ids in one request")
    parser.add_argument("--max-request-tokens", type=int, default=None,
                        help="the most KV-cache tokens one request may hold: for each of its sequences, prompt + "
                             "max_tokens (default: the whole KV pool)")
    parser.add_argument("--request-read-timeout", type=float, default=REQUEST_READ_TIMEOUT_S,
                        help="seconds a request's headers, and then its body, may take to arrive (else 408 / closed)")
    parser.add_argument("--timeout-keep-alive", type=float, default=5.0,
                        help="close an idle keep-alive connection after this many seconds")
    parser.add_argument("--limit-concurrency", type=int, default=LIMIT_CONCURRENCY,
                        help="the most connections and requests at once; past it new requests get 503")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds to let running requests finish before they are aborted")
    parser.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    add_engine_arguments(parser)


def serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until SIGTERM or Ctrl-C; returns the exit status (0 after a clean stop)."""

    llm = LLM(args.model, **engine_kwargs_from_args(args))
    name = args.served_model_name or args.model
    limits = api.RequestLimits(args.max_n, args.max_stop_strings, args.max_stop_string_chars, args.max_stop_token_ids)
    app = build_app(llm, name, args.api_key, args.max_waiting_requests, args.max_body_bytes, limits,
                    args.max_request_tokens, args.request_read_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            http=_with_header_timeout(args.request_read_timeout),
                            timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)  # a backstop: see _GracefulServer
    server = _GracefulServer(config, app.state.engine, args.shutdown_timeout)
    logging.getLogger("minfer").setLevel(args.log_level.upper())
    print(f"minfer: serving {name} ({llm.dtype}, {llm.device}) on http://{args.host}:{args.port}/v1", file=sys.stderr,
          flush=True)
    server.run()
    return 0


def _with_header_timeout(seconds: float) -> type:
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request line and headers have not all
    arrived `seconds` after it opened or after its last response (a slow-headers client holds a
    connection open for free otherwise)."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(seconds, self._headers_too_slow)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._header_timer.cancel()
            self._header_timer = self.loop.call_later(seconds, self._headers_too_slow)

        def connection_lost(self, exc) -> None:
            self._header_timer.cancel()
            super().connection_lost(exc)

        def _headers_too_slow(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # no request under way
                self.transport.close()

    return HeaderTimeoutH11Protocol


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, told that a signal means: stop admitting, let running requests finish for up to
    `shutdown_timeout` seconds, then end what is left (each stream with an error event and [DONE]), exit 0.

    (uvicorn itself re-raises the signal once it has stopped, which would end the process with -15;
    and at its own graceful timeout it cancels the handlers, which cuts streams without a word.)"""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout

    def handle_exit(self, sig, frame) -> None:
        self.engine.accepting = False
        if self.should_exit:  # a second signal: stop waiting for running requests
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        async def end_at_deadline() -> None:
            await asyncio.sleep(self.shutdown_timeout)
            self.engine.end_all(f"the server shut down before the request finished (--shutdown-timeout "
                                f"{self.shutdown_timeout:g} s)")

        deadline = asyncio.create_task(end_at_deadline())
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()
