"""Generation over OIP, as Triton's vLLM backend speaks it (decoupled: one request, many responses).

Inputs: `text_input` BYTES [1] (or `input_ids` INT64 [n] for pre-tokenized prompts),
`stream` BOOL [1], `sampling_parameters` BYTES [1] (JSON, vLLM's names),
`exclude_input_in_output` BOOL [1]; and `chat_messages` BYTES [1] (JSON, OpenAI's messages,
rendered with the tokenizer's chat template; the router's OpenAI API sends it).
Outputs: `text_output` BYTES (text prompts) and `output_ids` INT64.

- `stream` true, on ModelStreamInfer: a response per generated token with the new text (the
  prompt never repeated), every response carrying `triton_final_response` (false, and true on
  the last, which also carries `finish_reason`). When the stream's writer lags (its previous
  write not done as the next tokens come), the tokens that came meanwhile go in one response:
  `text_output` their text, `output_ids` their ids, `logprobs` one entry each,
  `num_output_tokens` the running total. Triton's vLLM backend does the same (a response per
  engine output, which may carry several tokens), and vLLM's benchmark measures ITL between
  such chunks.
- `stream` false (or absent): one response with the whole completion, flagged final on
  ModelStreamInfer; the prompt is prepended unless `exclude_input_in_output`. Unary
  ModelInfer answers this way; `stream` true there is UNIMPLEMENTED, as Triton answers a
  decoupled model on ModelInfer.

Every response carries `num_input_tokens` and `num_output_tokens` (so far) for metering, and
the executor's load and compile parameters; with `logprobs` asked for, a `logprobs` parameter
(JSON: per generated token `{"id", "token", "logprob", "top": [[id, logprob, token], ...]}`,
`token` the token's own text as the tokenizer decodes it alone, the top ones most likely first).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.executor.generation.engine_client import GenerationStream
from services.executor.generation.sampling import Choice
from services.executor.generation.scheduler import TokenEvent
from services.executor.generation.settings import SamplingParams, parse_sampling
from services.executor.generation.tokenizer import Tokenizer, parse_messages
from services.executor.loaded_model import LoadedModel
from switchyard import codec, oip_params
from switchyard.codec import WireTensor
from switchyard.errors import InvalidArgument, Unimplemented
from switchyard.gen.inference import grpc_service_pb2 as pb

FINAL = oip_params.FINAL
FINISH_REASON = oip_params.FINISH_REASON
NUM_INPUT_TOKENS = oip_params.NUM_INPUT_TOKENS
NUM_OUTPUT_TOKENS = oip_params.NUM_OUTPUT_TOKENS
LOGPROBS = oip_params.LOGPROBS
UNARY = oip_params.UNARY  # set by the router on requests it forwards for one answer

INPUTS = (
    "text_input",
    "input_ids",
    "chat_messages",
    "stream",
    "sampling_parameters",
    "exclude_input_in_output",
)


@dataclass(frozen=True)
class GenerationCall:
    prompt: list[int]
    prompt_text: str | None  # the prompt's text (decoded, when it came as input_ids)
    stream: bool
    exclude_input: bool
    params: SamplingParams
    wanted: frozenset[str]


def _scalar(t: WireTensor) -> Any:
    if t.array.size != 1:
        raise InvalidArgument(f"input {t.name!r} has shape {list(t.shape)}; send one element ([1])")
    return t.array.reshape(-1)[0]


def _text(t: WireTensor) -> str:
    value = _scalar(t)
    try:
        return bytes(value).decode()
    except UnicodeDecodeError:
        raise InvalidArgument(f"input {t.name!r} is not UTF-8 text") from None


def _flag(t: WireTensor) -> bool:
    if t.datatype != "BOOL":
        raise InvalidArgument(f"input {t.name!r} has datatype {t.datatype}; send BOOL")
    return bool(_scalar(t))


def parse_call(model: LoadedModel, tensors: list[WireTensor], wanted: list[str]) -> GenerationCall:
    engine = model.engine
    assert engine is not None
    by_name = {t.name: t for t in tensors}
    unknown = sorted(set(by_name) - set(INPUTS))
    if unknown:
        raise InvalidArgument(f"unknown input(s) {unknown}; {model.spec.name} takes {sorted(INPUTS)}")
    prompts = [n for n in ("text_input", "input_ids", "chat_messages") if n in by_name]
    if len(prompts) != 1:
        raise InvalidArgument(
            f"send exactly one of text_input, input_ids or chat_messages (got {prompts or 'none'})"
        )
    tokenizer = engine.tokenizer
    text: str | None
    if "input_ids" in by_name:
        t = by_name["input_ids"]
        if t.datatype not in ("INT64", "INT32"):
            raise InvalidArgument(f"input 'input_ids' has datatype {t.datatype}; send INT64")
        prompt = [int(v) for v in t.array.reshape(-1)]
        vocab = engine.vocab_size  # out-of-range ids are refused by the engine, with the fix
        text = tokenizer.decode([i for i in prompt if 0 <= i < vocab])  # text_output for token prompts too
    else:
        t = by_name[prompts[0]]
        if t.datatype != "BYTES":
            raise InvalidArgument(f"input {t.name!r} has datatype {t.datatype}; send BYTES")
        text = _text(t)
        if t.name == "chat_messages":
            try:
                messages = parse_messages(json.loads(text))
            except ValueError as exc:
                raise InvalidArgument(f"chat_messages is not JSON: {exc}") from None
            text = tokenizer.chat_prompt(messages)
        prompt = tokenizer.encode(text)
    raw_params = _text(by_name["sampling_parameters"]) if "sampling_parameters" in by_name else ""
    params = parse_sampling(raw_params, engine.vocab_size)
    outputs = {"text_output", "output_ids"}
    unknown_out = sorted(set(wanted) - outputs)
    if unknown_out:
        raise InvalidArgument(f"unknown output(s) {unknown_out}; {model.spec.name} has {sorted(outputs)}")
    return GenerationCall(
        prompt=prompt,
        prompt_text=text,
        stream=_flag(by_name["stream"]) if "stream" in by_name else False,
        exclude_input=_flag(by_name["exclude_input_in_output"])
        if "exclude_input_in_output" in by_name
        else False,
        params=params,
        wanted=frozenset(wanted or outputs),
    )


def _logprobs_json(choices: list[Choice], tokenizer: Tokenizer) -> str:
    def text(token: int) -> str:
        return tokenizer.decode([token])

    return json.dumps(
        [
            {
                "id": c.token,
                "token": text(c.token),
                "logprob": c.logprob,
                "top": [[t, lp, text(t)] for t, lp in c.top],
            }
            for c in choices
        ]
    )


class Responder:
    """Builds the responses of one call from its engine events."""

    def __init__(
        self, template: pb.ModelInferResponse, request_id: str, call: GenerationCall, tokenizer: Tokenizer
    ) -> None:
        self.call = call
        self.tokenizer = tokenizer
        # what every response of this call shares, set once: a response per token copies it
        self.template = pb.ModelInferResponse()
        self.template.CopyFrom(template)
        self.template.id = request_id
        self.template.parameters[NUM_INPUT_TOKENS].int64_param = len(call.prompt)
        self.template.parameters[oip_params.BATCH_SIZE].int64_param = 1  # busy_us is its own share

    def chunk(
        self, events: list[TokenEvent], busy_us: int, into: pb.ModelInferResponse
    ) -> pb.ModelInferResponse:
        """A streamed response of the tokens of `events` (their new text and ids), final when
        the last one finishes the request."""
        text = "".join(e.text for e in events) if self.call.prompt_text is not None else None
        ids = [t for e in events for t in e.token_ids]
        final = events[-1].finish_reason is not None
        return self.response(text, ids, events, final, True, busy_us, into)

    def response(
        self,
        text: str | None,
        ids: list[int],
        events: list[TokenEvent],
        final: bool | None,
        decoupled: bool,
        busy_us: int = 0,
        into: pb.ModelInferResponse | None = None,
    ) -> pb.ModelInferResponse:
        """`into`: the message to fill (a stream response's `infer_response`, so that it is not
        copied again), else a new one."""
        r = pb.ModelInferResponse() if into is None else into
        r.CopyFrom(self.template)
        if text is not None and "text_output" in self.call.wanted:
            r.outputs.add(name="text_output", datatype="BYTES", shape=[1])
            r.raw_output_contents.append(codec.encode_bytes([text.encode()]))
        if "output_ids" in self.call.wanted:
            r.outputs.add(name="output_ids", datatype="INT64", shape=[len(ids)])
            r.raw_output_contents.append(np.asarray(ids, dtype=np.int64).tobytes())
        params = r.parameters
        last = events[-1] if events else None
        params[NUM_OUTPUT_TOKENS].int64_param = last.output_tokens if last else 0
        if last is not None and last.finish_reason is not None:
            params[FINISH_REASON].string_param = last.finish_reason
        if self.call.params.logprobs is not None:
            params[LOGPROBS].string_param = _logprobs_json(
                [c for e in events for c in e.choices], self.tokenizer
            )
        if decoupled:
            params[FINAL].bool_param = bool(final)
        params[oip_params.COMPUTE_US].int64_param = busy_us  # device time so far
        return r


class StreamedResponses:
    """A streamed call's responses, each built when the RPC's writer comes to it (`take`) from
    every token that came since the last: one token when the writer keeps up, several when it
    lags (as Triton's vLLM backend sends a response per engine output, which may carry several
    tokens). The engine's events reach the writer straight: `attach` puts this object in the
    writer's queue whenever new events come to an empty buffer."""

    def __init__(
        self, responder: Responder, stream: GenerationStream, compilations: Callable[[], int]
    ) -> None:
        self.responder = responder
        self.stream = stream
        self.compilations = compilations
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def attach(self, out: asyncio.Queue[Any]) -> None:
        self.stream.on_ready(lambda: out.put_nowait(self))

    def take(self) -> pb.ModelStreamInferResponse | None:
        """The response of the tokens that came since the last one, or None (none came, or the
        generation failed: `done` then holds the error, for the caller's in-band answer)."""
        if self.done.done():
            return None
        events, error = self.stream.take()
        message = None
        if events:
            message = pb.ModelStreamInferResponse()
            response = self.responder.chunk(events, self.stream.busy_us, message.infer_response)
            response.parameters[oip_params.COMPILATIONS_AFTER_WARMUP].int64_param = self.compilations()
            if events[-1].finish_reason is not None:
                self.done.set_result(None)
        if error is not None and not self.done.done():
            self.done.set_exception(error)
        return message


async def whole_response(
    responder: Responder, stream: GenerationStream, decoupled: bool, compilations: Callable[[], int]
) -> pb.ModelInferResponse:
    """The whole completion in one response (`stream` false)."""
    call = responder.call
    events = [event async for event in stream]
    ids = [t for e in events for t in e.token_ids]
    text = "".join(e.text for e in events) if call.prompt_text is not None else None
    if not call.exclude_input:
        ids = call.prompt + ids
        if text is not None and call.prompt_text is not None:
            text = call.prompt_text + text
    response = responder.response(text, ids, events, True, decoupled, stream.busy_us)
    response.parameters[oip_params.COMPILATIONS_AFTER_WARMUP].int64_param = compilations()
    return response


def check_unary(call: GenerationCall) -> None:
    if call.stream:
        raise Unimplemented(
            "stream=true needs ModelStreamInfer (this model is decoupled: many responses per request); "
            "ModelInfer returns the whole completion with stream=false"
        )
