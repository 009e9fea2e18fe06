"""Names of the OIP parameters switchyard adds to inference responses (a contract).

A `ModelInferResponse` an executor returns carries these keys in `parameters` when its request
asks for them with `switchyard_stats` (bool, true), so the router can route least-loaded from
responses alone and the trial can prove that no compilation happened while measuring. Like
Triton's statistics they are opt-in: a request that does not ask gets the bare answer (name,
version, id, outputs), which costs no more than a hand-written server's (building and
encoding the eleven entries, and the caller decoding them, was about 10 us a request here):

| key | type | meaning |
|---|---|---|
| `backend` | string | the executor's backend (path): cpu, cuda, xla, tpu |
| `mode` | string | execution mode the model was prepared in: eager, compile, lazy, ... |
| `precision` | string | fp32, bf16, fp16 or fp64 |
| `executor` | string | id of the executor process that answered (host id and port) |
| `queue_us` | int64 | microseconds the request waited in the batching queue |
| `compute_us` | int64 | microseconds of the batch's compute, device synchronised |
| `batch_size` | int64 | requests in the executed batch |
| `padded_batch_size` | int64 | batch size after padding up to a bucket |
| `compilations_after_warmup` | int64 | compilations of this model since warm-up ended (must stay 0) |
| `in_flight` | int64 | other requests inside this executor (queued + computing) as this one is answered |
| `queue_depth` | int64 | requests of all models waiting in queues when answering |

Request parameters the executor reads:

- `switchyard_stats` (bool): answer with the parameters above. The router asks on every
  forwarded request (it routes and meters from them); the trial asks on its own.
- `timeout` (int64): Triton's per-request timeout in microseconds. A request still queued when
  it passes is dropped with DEADLINE_EXCEEDED, as with a gRPC deadline; the earlier applies
  (the executor's `data_plane.deadline_of`).
- `traceparent`, `tracestate` (string): W3C trace context of a request sent on a
  `ModelStreamInfer` stream, whose metadata is sent once per stream (the router's upstream
  streams send them).

Triton's shared-memory keys are refused with UNIMPLEMENTED.

Generation (a model with `[generation]`, answered by the executor's generation engine):
each response carries `triton_final_response` (bool, Triton's decoupled flag: true on the
last), `num_input_tokens` and `num_output_tokens` (int64, so far), `finish_reason` (string,
on the last: stop or length) and, when asked for, `logprobs` (string, JSON). A request that
carries `switchyard_unary` (bool; the router's one-answer path sets it) is answered once,
as ModelInfer answers it, even on a stream.
"""

from __future__ import annotations

BACKEND = "backend"
MODE = "mode"
PRECISION = "precision"
EXECUTOR = "executor"
QUEUE_US = "queue_us"
COMPUTE_US = "compute_us"
BATCH_SIZE = "batch_size"
PADDED_BATCH_SIZE = "padded_batch_size"
COMPILATIONS_AFTER_WARMUP = "compilations_after_warmup"
IN_FLIGHT = "in_flight"
QUEUE_DEPTH = "queue_depth"

# generation
FINAL = "triton_final_response"
FINISH_REASON = "finish_reason"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
LOGPROBS = "logprobs"

# request parameters
STATS = "switchyard_stats"
UNARY = "switchyard_unary"
TIMEOUT = "timeout"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

STRING_KEYS = (BACKEND, MODE, PRECISION, EXECUTOR)
INT_KEYS = (
    QUEUE_US,
    COMPUTE_US,
    BATCH_SIZE,
    PADDED_BATCH_SIZE,
    COMPILATIONS_AFTER_WARMUP,
    IN_FLIGHT,
    QUEUE_DEPTH,
)

# Triton's shared-memory request parameters; switchyard does not implement shared memory.
SHARED_MEMORY_KEYS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
