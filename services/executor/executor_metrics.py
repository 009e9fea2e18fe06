"""An executor's Prometheus metrics, with Triton's names and units.

Read at scrape time from the counters each loaded model's batcher keeps (the same numbers
ModelStatistics reports), so serving a request records nothing extra. Labels: `model` and
`version` as in Triton, plus `backend` (the path). Durations are cumulative microseconds,
counters have no `_total` suffix, as Triton exposes them on :8002/metrics:

- `nv_inference_request_success`, `nv_inference_request_failure{reason}` (counters): requests
  answered, and failed (REJECTED: queue full or expired in the queue; CANCELED; BACKEND:
  the compute raised).
- `nv_inference_count`, `nv_inference_exec_count`: inferences (batch rows), executions (batches).
- `nv_inference_request_duration_us`: end-to-end time in the executor of successful requests.
- `nv_inference_queue_duration_us`: time requests waited in the batching queue.
- `nv_inference_compute_input_duration_us`, `_infer_`, `_output_`: per request, its batch's
  input assembly, model run (device synchronised) and output split.
- `nv_inference_pending_request_count` (gauge): requests queued.
- `switchyard_inference_batch_executions{batch_size}`: executions per batch size (rows).
- `switchyard_inference_inline_requests` (counter): requests computed on the event loop, with
  no queue and no thread hand-off (a lone request on a quiet executor); the rest were queued
  for the device thread, where batches form.
- `switchyard_inference_in_flight` (gauge): requests inside the executor.
- `switchyard_compilations_after_warmup` (gauge): compilations since warm-up (must stay 0).
- `switchyard_model_load_compilations`, `switchyard_model_compile_seconds` (gauges):
  compilations and compile/warm-up time of the model's load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from services.executor.executor_runtime import Executor
from switchyard.metrics_endpoint import CallbackCollector, counter, gauge

LABELS = ("model", "version", "backend")


def collector(executor: Executor) -> CallbackCollector:
    return CallbackCollector(lambda: families(executor))


_DOC = "(Triton's name and unit)"

# Counters read straight off a batcher's counters: (name, help, value).
_BATCHER_COUNTERS: tuple[tuple[str, str, Callable[[Any], int]], ...] = (
    ("nv_inference_request_success", f"Successful inference requests {_DOC}", lambda c: c.success),
    ("nv_inference_count", f"Inferences performed, batch rows counted {_DOC}", lambda c: c.rows),
    ("nv_inference_exec_count", f"Model executions (batches) {_DOC}", lambda c: c.executions),
    (
        "nv_inference_request_duration_us",
        f"Cumulative request duration {_DOC}",
        lambda c: c.success_ns // 1000,
    ),
    ("nv_inference_queue_duration_us", f"Cumulative queue time {_DOC}", lambda c: c.queue_ns // 1000),
    (
        "nv_inference_compute_input_duration_us",
        f"Cumulative input time {_DOC}",
        lambda c: c.request_input_ns // 1000,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        f"Cumulative compute time {_DOC}",
        lambda c: c.request_infer_ns // 1000,
    ),
    (
        "nv_inference_compute_output_duration_us",
        f"Cumulative output time {_DOC}",
        lambda c: c.request_output_ns // 1000,
    ),
    (
        "switchyard_inference_inline_requests",
        "Requests computed on the event loop, without the queue or the device thread",
        lambda c: c.ran_inline,
    ),
)


def families(executor: Executor) -> Iterable[Any]:
    backend = executor.backend.name
    plain = [(counter(name, doc, LABELS), value) for name, doc, value in _BATCHER_COUNTERS]
    failure = counter(
        "nv_inference_request_failure", f"Failed inference requests {_DOC}", (*LABELS, "reason")
    )
    pending = gauge("nv_inference_pending_request_count", f"Requests waiting in the queue {_DOC}", LABELS)
    by_batch = counter(
        "switchyard_inference_batch_executions",
        "Model executions per batch size (rows)",
        (*LABELS, "batch_size"),
    )
    compiled = gauge(
        "switchyard_compilations_after_warmup", "Compilations since warm-up ended (must stay 0)", LABELS
    )
    load_compilations = gauge(
        "switchyard_model_load_compilations", "Compilations during the model's load", LABELS
    )
    compile_s = gauge(
        "switchyard_model_compile_seconds", "Compile and warm-up time of the model's load", LABELS
    )
    in_flight = gauge("switchyard_inference_in_flight", "Requests inside the executor", ("backend",))
    in_flight.add_metric([backend], executor.in_flight)
    for (name, version), model in list(executor.models.items()):
        labels = (name, version, backend)
        compiled.add_metric(list(labels), model.compilations_after_warmup())
        load_compilations.add_metric(list(labels), model.findings.during_load.compilations)
        compile_s.add_metric(list(labels), model.times.compile_s)
        batcher = model.batcher
        if batcher is None:
            continue
        c = batcher.counters
        for family, value in plain:
            family.add(labels, value(c))
        for reason, n in (
            ("REJECTED", c.rejected_queue_full + c.expired_in_queue),
            ("CANCELED", c.cancelled_in_queue),
            ("BACKEND", c.failed_compute),
        ):
            failure.add((*labels, reason), n)
        pending.add_metric(list(labels), batcher.depth)
        for size, (n, *_phases) in sorted(c.by_batch_size.items()):
            by_batch.add((*labels, str(size)), n)
    return (
        *(family for family, _ in plain),
        failure,
        pending,
        by_batch,
        compiled,
        load_compilations,
        compile_s,
        in_flight,
    )
