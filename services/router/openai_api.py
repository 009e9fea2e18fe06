"""An OpenAI-compatible HTTP API on the router: /v1/models, /v1/completions, /v1/chat/completions.

A small asyncio HTTP/1.1 server (h11: the protocol state machine, no framework). Each
completion becomes one OIP request to the route's generative model (the inputs Triton's vLLM
backend takes: `text_input` or `chat_messages`, `stream`, `sampling_parameters`,
`exclude_input_in_output`) and goes through `RequestPath.generate`: the same bearer keys, routes,
failover and metering as gRPC callers get. `stream: true` answers with server-sent events
(`data: {chunk}` per token, then `data: [DONE]`; `stream_options.include_usage` adds a last
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
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import h11
import numpy as np

from services.router.request_path import RequestPath
from switchyard import codec, ids, oip_params
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

# Request fields -> sampling parameter names (vLLM's); None: accepted and not passed on.
COMMON = {
    "model": None,
    "stream": None,
    "stream_options": None,
    "user": None,
    "n": None,  # one OIP request per choice (the engine generates one sequence a request)
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "min_tokens": "min_tokens",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
COMPLETIONS = {**COMMON, "prompt": None, "echo": None, "logprobs": None}
CHAT = {
    **COMMON,
    "messages": None,
    "max_completion_tokens": "max_tokens",
    "logprobs": None,
    "top_logprobs": None,
}
MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20  # the engine's bound (services/executor/generation/settings.py)


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def _error_of(exc: BaseException) -> HttpError:
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, SwitchyardError):
        return HttpError(HTTP_STATUS.get(exc.status.value, 500), str(exc), exc.status.value)
    return HttpError(500, "internal error; see the router's log", "INTERNAL")


def _error_body(error: HttpError) -> dict[str, Any]:
    kind = ERROR_TYPE.get(error.status, "api_error")
    return {"error": {"message": error.message, "type": kind, "param": None, "code": error.code or None}}


def _tensor(request: pb.ModelInferRequest, name: str, datatype: str, shape: list[int], raw: bytes) -> None:
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.append(raw)


def _count(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HttpError(400, f"`{name}` is {value!r}; use an integer from {low} to {high}")
    return value


def choices_of(body: dict[str, Any]) -> int:
    """`n`: how many choices (1 when absent)."""
    return _count(body, "n", 1, MAX_N) or 1


def top_logprobs_of(kind: str, body: dict[str, Any]) -> int | None:
    """How many top tokens' logprobs each generated token carries (None: no logprobs)."""
    if kind == "completions":
        top = _count(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and body.get("echo"):
            raise HttpError(
                400, "`echo` with `logprobs` is not supported: the engine has no logprobs of the prompt"
            )
        return top
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise HttpError(400, "`logprobs` must be true or false")
    top = _count(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise HttpError(400, "`top_logprobs` needs `logprobs: true`")
    return (top or 0) if wanted else None


def build_request(
    kind: str, body: dict[str, Any], request_id: str, choice: int = 0
) -> tuple[pb.ModelInferRequest, bool]:
    """The OIP request for a completion body (its `choice`-th choice); returns it and whether
    to stream."""
    allowed = CHAT if kind == "chat" else COMPLETIONS
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise HttpError(400, f"unsupported field(s) {unknown}; this API takes {sorted(allowed)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise HttpError(400, "`model` is required: the name of a route (GET /v1/models lists them)")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HttpError(400, "`stream` must be true or false")
    sampling = {allowed[k]: v for k, v in body.items() if allowed.get(k) and v is not None}
    choices_of(body)  # checked before anything runs
    top = top_logprobs_of(kind, body)
    if top is not None:
        sampling["logprobs"] = top
    seed = body.get("seed")
    if choice and isinstance(seed, int) and not isinstance(seed, bool):
        sampling["seed"] = seed + choice  # distinct choices, each reproducible
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "`messages` must be a non-empty list of {role, content}")
        _tensor(request, "chat_messages", "BYTES", [1], codec.encode_bytes([json.dumps(messages).encode()]))
        exclude = True
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            _tensor(request, "input_ids", "INT64", [len(prompt)], np.asarray(prompt, np.int64).tobytes())
        elif isinstance(prompt, str):
            _tensor(request, "text_input", "BYTES", [1], codec.encode_bytes([prompt.encode()]))
        else:
            raise HttpError(400, "`prompt` must be a string, a list of one string, or a list of token ids")
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise HttpError(400, "`echo` must be true or false")
        exclude = not echo
    sampling.setdefault("max_tokens", 16 if kind == "completions" else None)
    sampling = {k: v for k, v in sampling.items() if v is not None}
    _tensor(request, "stream", "BOOL", [1], np.array([stream]).tobytes())
    _tensor(request, "sampling_parameters", "BYTES", [1], codec.encode_bytes([json.dumps(sampling).encode()]))
    _tensor(request, "exclude_input_in_output", "BOOL", [1], np.array([exclude]).tobytes())
    return request, stream


def _text(response: pb.ModelInferResponse) -> str:
    for i, out in enumerate(response.outputs):
        if out.name == "text_output":
            return str(
                codec.decode_numpy("BYTES", out.shape, response.raw_output_contents[i])
                .reshape(-1)[0]
                .decode()
            )
    return ""


def _param(response: pb.ModelInferResponse, key: str) -> Any:
    if key not in response.parameters:
        return None
    value = response.parameters[key]
    return getattr(value, value.WhichOneof("parameter_choice") or "string_param")


class OpenAIServer:
    def __init__(self, path: RequestPath, max_body: int = MAX_BODY) -> None:
        self.path = path
        self.max_body = max_body
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("OpenAI-compatible API on http://%s:%d/v1", host, self.port)
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    # ---- HTTP/1.1 ------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        peer = "ipv4:{}:{}".format(*writer.get_extra_info("peername")[:2])
        try:
            while True:
                event = await self._next(conn, reader)
                if not isinstance(event, h11.Request):
                    break
                body = bytearray()
                while not isinstance(part := await self._next(conn, reader), h11.EndOfMessage):
                    if isinstance(part, h11.Data):
                        body += part.data
                        if len(body) > self.max_body:
                            raise HttpError(413, f"the request body is over {self.max_body} bytes")
                    elif isinstance(part, h11.ConnectionClosed):
                        return
                await self._handle(conn, writer, event, bytes(body), peer)
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    break
                conn.start_next_cycle()
        except HttpError as exc:
            with contextlib.suppress(Exception):
                await self._json(conn, writer, exc.status, _error_body(exc))
        except (h11.RemoteProtocolError, h11.LocalProtocolError) as exc:
            with contextlib.suppress(Exception):
                await self._json(conn, writer, 400, _error_body(HttpError(400, f"bad HTTP request: {exc}")))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def _next(self, conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await reader.read(65536)
            conn.receive_data(data)  # b"" marks the end

    async def _send(self, conn: h11.Connection, writer: asyncio.StreamWriter, *events: Any) -> None:
        for event in events:
            data = conn.send(event)
            if data:
                writer.write(data)
        await writer.drain()

    async def _json(self, conn: h11.Connection, writer: asyncio.StreamWriter, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(data)))]
        await self._send(
            conn,
            writer,
            h11.Response(status_code=status, headers=headers),
            h11.Data(data=data),
            h11.EndOfMessage(),
        )

    # ---- the API ---------------------------------------------------------------------------
    async def _handle(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, request: h11.Request, body: bytes, peer: str
    ) -> None:
        target = request.target.decode().split("?", 1)[0].rstrip("/")
        method = request.method.decode()
        metadata = [
            (k.decode().lower(), v.decode()) for k, v in request.headers if k.lower() == b"authorization"
        ]
        try:
            if target == "/v1/models" and method == "GET":
                await self._json(conn, writer, 200, await self._models(metadata, peer))
                return
            kinds = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
            if target not in kinds:
                raise HttpError(
                    404,
                    f"no route {method} {target}; this API serves /v1/models, /v1/completions and "
                    "/v1/chat/completions",
                )
            if method != "POST":
                raise HttpError(405, f"{target} takes POST")
            try:
                parsed = json.loads(body)
            except ValueError as exc:
                raise HttpError(400, f"the body is not JSON: {exc}") from None
            if not isinstance(parsed, dict):
                raise HttpError(400, "the body must be a JSON object")
            await self._completion(conn, writer, kinds[target], parsed, metadata, peer)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as exc:
            error = _error_of(exc)
            if error.status == 500 and not isinstance(exc, HttpError | SwitchyardError):
                log.exception("OpenAI API request failed")
            if conn.our_state is h11.SEND_RESPONSE:
                await self._json(conn, writer, error.status, _error_body(error))
            elif conn.our_state is h11.SEND_BODY:  # mid-stream: an SSE error event, then the end
                await self._send(
                    conn,
                    writer,
                    h11.Data(data=b"data: " + json.dumps(_error_body(error)).encode() + b"\n\n"),
                    h11.EndOfMessage(),
                )

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
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
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
            if not stream:
                await self._whole(conn, writer, kind, head, n, responses)
                return
            await self._events(conn, writer, kind, head, n, responses, include_usage)
        finally:
            await responses.aclose()

    async def _whole(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        kind: str,
        head: dict[str, Any],
        n: int,
        responses: AsyncIterator[tuple[int, pb.ModelInferResponse]],
    ) -> None:
        texts, reasons = [""] * n, [None] * n
        logprobs: list[Logprobs | None] = [None] * n
        usage = Usage(n)
        async for i, response in responses:
            texts[i] += _text(response)
            reasons[i] = _param(response, oip_params.FINISH_REASON) or reasons[i]
            usage.add(i, response)
            entries = _logprob_entries(response)
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
        await self._json(
            conn, writer, 200, {**head, "object": obj, "choices": choices, "usage": usage.body()}
        )

    async def _events(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        kind: str,
        head: dict[str, Any],
        n: int,
        responses: AsyncIterator[tuple[int, pb.ModelInferResponse]],
        include_usage: bool,
    ) -> None:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        started = False
        usage = Usage(n)
        first = [True] * n
        offsets = [0] * n  # completions' text_offset runs on across a choice's chunks
        async for i, response in responses:
            if not started:  # headers only once the first token came: errors before it get a status
                headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
                await self._send(conn, writer, h11.Response(status_code=200, headers=headers))
                started = True
            text = _text(response)
            reason = _param(response, oip_params.FINISH_REASON)
            usage.add(i, response)
            entries = _logprob_entries(response)
            logprobs = None
            if entries is not None:
                lp = Logprobs(kind, offsets[i])
                lp.add(entries)
                offsets[i] = lp.offset
                logprobs = lp.body()
            if kind == "chat":
                delta: dict[str, Any] = {"content": text}
                if first[i]:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {
                    "index": i,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                }
            else:
                choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
            first[i] = False
            chunk = {**head, "object": obj, "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            await self._send(conn, writer, h11.Data(data=b"data: " + json.dumps(chunk).encode() + b"\n\n"))
        if include_usage:
            last = {**head, "object": obj, "choices": [], "usage": usage.body()}
            await self._send(conn, writer, h11.Data(data=b"data: " + json.dumps(last).encode() + b"\n\n"))
        await self._send(conn, writer, h11.Data(data=b"data: [DONE]\n\n"), h11.EndOfMessage())


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

    async def pump(i: int, generation: AsyncGenerator[pb.ModelInferResponse]) -> None:
        try:
            async for response in generation:
                await queue.put((i, response))
        except Exception as exc:
            await queue.put((i, exc))
            return
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
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


class Usage:
    """OpenAI's `usage` of n choices: the prompt once, the completion tokens of every choice."""

    def __init__(self, n: int) -> None:
        self.prompt = 0
        self.completion = [0] * n

    def add(self, choice: int, response: pb.ModelInferResponse) -> None:
        self.prompt = int(_param(response, oip_params.NUM_INPUT_TOKENS) or self.prompt)
        self.completion[choice] = int(
            _param(response, oip_params.NUM_OUTPUT_TOKENS) or self.completion[choice]
        )

    def body(self) -> dict[str, int]:
        completion = sum(self.completion)
        return {
            "prompt_tokens": self.prompt,
            "completion_tokens": completion,
            "total_tokens": self.prompt + completion,
        }


def _logprob_entries(response: pb.ModelInferResponse) -> list[dict[str, Any]] | None:
    """The executor's logprobs of a response (oip.py's JSON), or None when not asked for."""
    raw = _param(response, oip_params.LOGPROBS)
    return None if raw is None else list(json.loads(raw))


class Logprobs:
    """A choice's logprobs in OpenAI's shape: chat `{"content": [{token, logprob, bytes,
    top_logprobs}]}`; completions `{tokens, token_logprobs, top_logprobs, text_offset}`, the top
    ones a {token: logprob} map with the chosen token always in it (so up to logprobs + 1, as
    OpenAI and vLLM answer), offsets into the choice's text."""

    def __init__(self, kind: str, offset: int = 0) -> None:
        self.kind = kind
        self.offset = offset
        self.content: list[dict[str, Any]] = []
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top: list[dict[str, float]] = []
        self.text_offset: list[int] = []

    def add(self, entries: list[dict[str, Any]]) -> None:
        for e in entries:
            token, logprob = str(e["token"]), float(e["logprob"])
            top = [(str(text), float(lp)) for _, lp, text in e["top"]]
            if self.kind == "chat":
                self.content.append(
                    {
                        "token": token,
                        "logprob": logprob,
                        "bytes": list(token.encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top
                        ],
                    }
                )
                continue
            self.tokens.append(token)
            self.token_logprobs.append(logprob)
            ranked = dict(top)
            ranked[token] = logprob  # the chosen token always, with its own logprob
            self.top.append(ranked)
            self.text_offset.append(self.offset)
            self.offset += len(token)

    def body(self) -> dict[str, Any]:
        if self.kind == "chat":
            return {"content": self.content, "refusal": None}
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top,
            "text_offset": self.text_offset,
        }
