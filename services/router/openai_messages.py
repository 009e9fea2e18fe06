"""OpenAI's request and response bodies, as the router's OpenAI API (`openai_api`) reads and writes them.

A completion body becomes one OIP request per choice to the route's generative model, with the
inputs Triton's vLLM backend takes (`text_input` or `chat_messages`, `stream`,
`sampling_parameters`, `exclude_input_in_output`); a field this API does not take is refused
with 400 naming it. Back the other way: the text of a response, the usage of all choices (the
prompt counted once), and the engine's logprobs in OpenAI's shapes.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from services.router.http1_server import HttpError
from switchyard import codec, oip_params
from switchyard.gen.inference import grpc_service_pb2 as pb

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
    exclude = _add_prompt(kind, body, request)
    sampling.setdefault("max_tokens", 16 if kind == "completions" else None)
    sampling = {k: v for k, v in sampling.items() if v is not None}
    _tensor(request, "stream", "BOOL", [1], np.array([stream]).tobytes())
    _tensor(request, "sampling_parameters", "BYTES", [1], codec.encode_bytes([json.dumps(sampling).encode()]))
    _tensor(request, "exclude_input_in_output", "BOOL", [1], np.array([exclude]).tobytes())
    return request, stream


def _add_prompt(kind: str, body: dict[str, Any], request: pb.ModelInferRequest) -> bool:
    """The prompt's input (chat messages, text or token ids); returns whether the output is to
    exclude it (chat always; a completion unless `echo`)."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "`messages` must be a non-empty list of {role, content}")
        _tensor(request, "chat_messages", "BYTES", [1], codec.encode_bytes([json.dumps(messages).encode()]))
        return True
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
    return not echo


def text_of(response: pb.ModelInferResponse) -> str:
    for i, out in enumerate(response.outputs):
        if out.name == "text_output":
            return str(
                codec.decode_numpy("BYTES", out.shape, response.raw_output_contents[i])
                .reshape(-1)[0]
                .decode()
            )
    return ""


def param_of(response: pb.ModelInferResponse, key: str) -> Any:
    if key not in response.parameters:
        return None
    value = response.parameters[key]
    return getattr(value, value.WhichOneof("parameter_choice") or "string_param")


class Usage:
    """OpenAI's `usage` of n choices: the prompt once, the completion tokens of every choice."""

    def __init__(self, n: int) -> None:
        self.prompt = 0
        self.completion = [0] * n

    def add(self, choice: int, response: pb.ModelInferResponse) -> None:
        self.prompt = int(param_of(response, oip_params.NUM_INPUT_TOKENS) or self.prompt)
        self.completion[choice] = int(
            param_of(response, oip_params.NUM_OUTPUT_TOKENS) or self.completion[choice]
        )

    def body(self) -> dict[str, int]:
        completion = sum(self.completion)
        return {
            "prompt_tokens": self.prompt,
            "completion_tokens": completion,
            "total_tokens": self.prompt + completion,
        }


def logprob_entries(response: pb.ModelInferResponse) -> list[dict[str, Any]] | None:
    """The executor's logprobs of a response (oip.py's JSON), or None when not asked for."""
    raw = param_of(response, oip_params.LOGPROBS)
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
