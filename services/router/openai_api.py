"""An OpenAI-compatible HTTP API on the router: /v1/models, /v1/completions, /v1/chat/completions.

Served on the small HTTP/1.1 server of `http1_server` (h11, no framework); the bodies are
built and read in `openai_messages`. Each
completion becomes one OIP request to the route's generative model (the inputs Triton's vLLM
backend takes: `text_input` or `chat_messages`, `stream`, `sampling_parameters`,
`exclude_input_in_output`) and goes through `RequestPath.generate`: the same bearer keys, routes,
failover and metering as gRPC callers get. `stream: true` answers with server-sent events
(`data: {chunk}` per executor response: a token, or several that came while the stream
lagged; then `data: [DONE]`; `stream_options.include_usage` adds a last
chunk with the usage). `usage` counts the executor's prompt and completion tokens.
`n` > 1: each choice is its own OIP request (its own prefill, usage event and job), run at
once and merged; with a `seed`, choice i samples with seed + i, so the choices differ and each
is reproducible. `usage` counts the prompt once and the completion tokens of every choice, as
OpenAI does. `logprobs` (completions: the number of top tokens; chat: `logprobs` and
`top_logprobs`) are the engine's logprobs of the chosen and top tokens, in OpenAI's shapes.
Errors are OpenAI's shape (`{"error": {"message", "type", "code"}}`) with the HTTP status of
the gRPC one. Not supported (refused with 400 naming the field): tools, `echo` with
`logprobs` (the engine has no prompt logprobs).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import h11

from services.router import ids
from services.router.http1_server import Http1Server, HttpError, HttpExchange
from services.router.openai_messages import (
    Logprobs,
    Usage,
    build_request,
    choices_of,
    logprob_entries,
    param_of,
    text_of,
)
from services.router.request_path import RequestPath
from switchyard import oip_params
from switchyard.errors import SwitchyardError
from switchyard.gen.inference import grpc_service_pb2 as pb

log = logging.getLogger(__name__)

MAX_BODY = 4 * 1024 * 1024
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 429: "rate_limit_error"}  # fmt: skip


def _error_of(exc: BaseException) -> HttpError:
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, SwitchyardError):
        return HttpError(HTTP_STATUS.get(exc.status.value, 500), str(exc), exc.status.value)
    return HttpError(500, "internal error; see the router's log", "INTERNAL")


def _error_body(error: HttpError) -> dict[str, Any]:
    kind = ERROR_TYPE.get(error.status, "api_error")
    return {"error": {"message": error.message, "type": kind, "param": None, "code": error.code or None}}


class OpenAIServer(Http1Server):
    def __init__(self, path: RequestPath, max_body: int = MAX_BODY) -> None:
        super().__init__(max_body)
        self.path = path

    async def start(self, host: str, port: int, tls: tuple[bytes, bytes] | None = None) -> int:
        await super().start(host, port, tls)
        scheme = "https" if tls is not None else "http"
        log.info("OpenAI-compatible API on %s://%s:%d/v1", scheme, host, self.port)
        return self.port

    def error_body(self, error: HttpError) -> dict[str, Any]:
        return _error_body(error)

    async def handle(self, exchange: HttpExchange, request: h11.Request, body: bytes, peer: str) -> None:
        target = request.target.decode().split("?", 1)[0].rstrip("/")
        method = request.method.decode()
        metadata = [
            (k.decode().lower(), v.decode()) for k, v in request.headers if k.lower() == b"authorization"
        ]
        try:
            if target == "/v1/models" and method == "GET":
                await exchange.json(200, await self._models(metadata, peer))
                return
            kind = _completion_kind(target, method)
            await self._completion(exchange, kind, _json_object(body), metadata, peer)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as exc:
            error = _error_of(exc)
            if error.status == 500 and not isinstance(exc, HttpError | SwitchyardError):
                log.exception("OpenAI API request failed")
            if not exchange.started:
                await exchange.json(error.status, _error_body(error))
            elif exchange.streaming:  # mid-stream: an SSE error event, then the end
                await exchange.event(_error_body(error), end=True)

    async def _models(self, metadata: list[tuple[str, str]], peer: str) -> dict[str, Any]:
        admission = self.path.admission
        identity = await admission.identify(metadata, "http:/v1/models", ids.time_ordered_hex(), peer)
        data = [
            {"id": model, "object": "model", "created": 0, "owned_by": "switchyard"}
            for model in admission.visible_models(identity, sorted(self.path.routes))
        ]
        return {"object": "list", "data": data}

    async def _completion(
        self,
        exchange: HttpExchange,
        kind: str,
        body: dict[str, Any],
        metadata: list[tuple[str, str]],
        peer: str,
    ) -> None:
        request_id = ids.time_ordered_hex()
        n = choices_of(body)
        built = [
            build_request(kind, body, request_id if i == 0 else f"{request_id}-{i}", i) for i in range(n)
        ]
        stream = built[0][1]
        model = built[0][0].model_name
        options = body.get("stream_options") or {}
        include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
        generations = [
            self.path.generate(request.SerializeToString(), metadata, None, peer) for request, _ in built
        ]
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        head = {"id": prefix + request_id, "created": int(time.time()), "model": model}
        responses = merged(generations)
        try:
            if stream:
                await _events(exchange, kind, head, n, responses, include_usage)
            else:
                await exchange.json(200, await _whole(kind, head, n, responses))
        finally:
            await responses.aclose()


def _completion_kind(target: str, method: str) -> str:
    """ "completions" or "chat" for the request's path; 404 or 405 for any other."""
    kinds = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
    if target not in kinds:
        raise HttpError(
            404,
            f"no route {method} {target}; this API serves /v1/models, /v1/completions and "
            "/v1/chat/completions",
        )
    if method != "POST":
        raise HttpError(405, f"{target} takes POST")
    return kinds[target]


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body)
    except ValueError as exc:
        raise HttpError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise HttpError(400, "the body must be a JSON object")
    return parsed


async def _whole(
    kind: str, head: dict[str, Any], n: int, responses: AsyncIterator[tuple[int, pb.ModelInferResponse]]
) -> dict[str, Any]:
    """A completion answered whole: each choice's text, finish reason and logprobs, the usage."""
    texts, reasons = [""] * n, [None] * n
    logprobs: list[Logprobs | None] = [None] * n
    usage = Usage(n)
    async for i, response in responses:
        texts[i] += text_of(response)
        reasons[i] = param_of(response, oip_params.FINISH_REASON) or reasons[i]
        usage.add(i, response)
        entries = logprob_entries(response)
        if entries is not None:
            found = logprobs[i] = logprobs[i] or Logprobs(kind)
            found.add(entries)
    choices = []
    for i in range(n):
        lp = logprobs[i]
        choice: dict[str, Any] = {
            "index": i,
            "logprobs": lp.body() if lp is not None else None,
            "finish_reason": reasons[i],
        }
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": texts[i]}
        else:
            choice["text"] = texts[i]
        choices.append(choice)
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {**head, "object": obj, "choices": choices, "usage": usage.body()}


async def _events(
    exchange: HttpExchange,
    kind: str,
    head: dict[str, Any],
    n: int,
    responses: AsyncIterator[tuple[int, pb.ModelInferResponse]],
    include_usage: bool,
) -> None:
    """A completion streamed as server-sent events: a chunk per response, then `[DONE]`."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    started = False
    usage = Usage(n)
    first = [True] * n
    offsets = [0] * n  # completions' text_offset runs on across a choice's chunks
    async for i, response in responses:
        if not started:  # headers only once the first token came: errors before it get a status
            await exchange.start_events()
            started = True
        usage.add(i, response)
        entries = logprob_entries(response)
        logprobs = None
        if entries is not None:
            lp = Logprobs(kind, offsets[i])
            lp.add(entries)
            offsets[i] = lp.offset
            logprobs = lp.body()
        chunk = {**head, "object": obj, "choices": [_chunk_choice(kind, i, response, logprobs, first[i])]}
        first[i] = False
        if include_usage:
            chunk["usage"] = None
        await exchange.event(chunk)
    if include_usage:
        await exchange.event({**head, "object": obj, "choices": [], "usage": usage.body()})
    await exchange.event("[DONE]", end=True)


def _chunk_choice(
    kind: str, i: int, response: pb.ModelInferResponse, logprobs: Any, first: bool
) -> dict[str, Any]:
    text = text_of(response)
    reason = param_of(response, oip_params.FINISH_REASON)
    if kind != "chat":
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
    delta: dict[str, Any] = {"content": text}
    if first:
        delta["role"] = "assistant"
    return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


async def merged(
    generations: list[AsyncGenerator[pb.ModelInferResponse]],
) -> AsyncGenerator[tuple[int, pb.ModelInferResponse]]:
    """(choice, response) as each choice's generation answers; the first error ends them all
    (the others are cancelled, and metered as far as they got)."""
    if len(generations) == 1:
        try:
            async for response in generations[0]:
                yield 0, response
        finally:
            await generations[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, pb.ModelInferResponse | BaseException | None]] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(queue, i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for generation in generations:
            await generation.aclose()


async def _pump(
    queue: asyncio.Queue[tuple[int, pb.ModelInferResponse | BaseException | None]],
    i: int,
    generation: AsyncGenerator[pb.ModelInferResponse],
) -> None:
    """Choice i's responses into the queue, then None (or the error that ended it)."""
    try:
        async for response in generation:
            await queue.put((i, response))
    except Exception as exc:
        await queue.put((i, exc))
        return
    await queue.put((i, None))
