"""An OpenAI-compatible HTTP API on the router: /v1/models, /v1/completions, /v1/chat/completions.

A small asyncio HTTP/1.1 server (h11: the protocol state machine, no framework). Each
completion becomes one OIP request to the route's generative model (the inputs Triton's vLLM
backend takes: `text_input` or `chat_messages`, `stream`, `sampling_parameters`,
`exclude_input_in_output`) and goes through `Router.generate`: the same bearer keys, routes,
failover and metering as gRPC callers get. `stream: true` answers with server-sent events
(`data: {chunk}` per token, then `data: [DONE]`; `stream_options.include_usage` adds a last
chunk with the usage). `usage` counts the executor's prompt and completion tokens.
Errors are OpenAI's shape (`{"error": {"message", "type", "code"}}`) with the HTTP status of
the gRPC one. Not supported (refused with 400 naming the field): n > 1, logprobs, tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import h11
import numpy as np

from services.router.auth import authorize
from services.router.forward import Router
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
    "n": "n",
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
COMPLETIONS = {**COMMON, "prompt": None, "echo": None}
CHAT = {**COMMON, "messages": None, "max_completion_tokens": "max_tokens"}


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


def build_request(kind: str, body: dict[str, Any], request_id: str) -> tuple[pb.ModelInferRequest, bool]:
    """The OIP request for a completion body; returns it and whether to stream."""
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
    def __init__(self, router: Router, max_body: int = MAX_BODY) -> None:
        self.router = router
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
        identity = await self.router.identify(metadata, "http:/v1/models", ids.time_ordered_hex(), peer)
        data = []
        for model in sorted(self.router.routes):
            try:
                authorize(identity, model)
            except SwitchyardError:
                continue
            data.append({"id": model, "object": "model", "created": 0, "owned_by": "switchyard"})
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
        request, stream = build_request(kind, body, request_id)
        model = request.model_name
        options = body.get("stream_options") or {}
        include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
        responses = self.router.generate(request.SerializeToString(), metadata, None, peer)
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        head = {"id": prefix + request_id, "created": int(time.time()), "model": model}
        try:
            if not stream:
                text, reason, usage = "", None, {}
                async for response in responses:
                    text += _text(response)
                    reason = _param(response, oip_params.FINISH_REASON) or reason
                    usage = _usage(response)
                choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
                if kind == "chat":
                    choice["message"] = {"role": "assistant", "content": text}
                    obj = "chat.completion"
                else:
                    choice["text"] = text
                    obj = "text_completion"
                await self._json(
                    conn, writer, 200, {**head, "object": obj, "choices": [choice], "usage": usage}
                )
                return
            await self._events(conn, writer, kind, head, responses, include_usage)
        finally:
            await responses.aclose()

    async def _events(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        kind: str,
        head: dict[str, Any],
        responses: AsyncIterator[pb.ModelInferResponse],
        include_usage: bool,
    ) -> None:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        started = False
        usage: dict[str, int] = {}
        first = True
        async for response in responses:
            if not started:  # headers only once the first token came: errors before it get a status
                headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
                await self._send(conn, writer, h11.Response(status_code=200, headers=headers))
                started = True
            text = _text(response)
            reason = _param(response, oip_params.FINISH_REASON)
            usage = _usage(response)
            if kind == "chat":
                delta: dict[str, Any] = {"content": text}
                if first:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": reason,
                }
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            first = False
            chunk = {**head, "object": obj, "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            await self._send(conn, writer, h11.Data(data=b"data: " + json.dumps(chunk).encode() + b"\n\n"))
        if include_usage:
            last = {**head, "object": obj, "choices": [], "usage": usage}
            await self._send(conn, writer, h11.Data(data=b"data: " + json.dumps(last).encode() + b"\n\n"))
        await self._send(conn, writer, h11.Data(data=b"data: [DONE]\n\n"), h11.EndOfMessage())


def _usage(response: pb.ModelInferResponse) -> dict[str, int]:
    prompt = int(_param(response, oip_params.NUM_INPUT_TOKENS) or 0)
    completion = int(_param(response, oip_params.NUM_OUTPUT_TOKENS) or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
