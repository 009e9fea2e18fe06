"""OpenTelemetry metrics of an executor (DESIGN §8): request latency, queue wait and compute
time per model and path, batch sizes, queue depth and in-flight requests, compilations after
warm-up.

Instruments exist only when the process installed a meter provider (`switchyard.telemetry.
setup`); otherwise `ExecutorMetrics.create` returns None and the hot path records nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation


@dataclass
class ExecutorMetrics:
    backend: str
    latency_us: Any
    queue_us: Any
    compute_us: Any
    batch_size: Any

    @classmethod
    def create(
        cls,
        backend: str,
        load: Callable[[], tuple[int, int]],
        compilations: Callable[[], dict[str, int]],
        meter: metrics.Meter | None = None,
    ) -> ExecutorMetrics | None:
        """Instruments on `meter`, else on the process's provider; None when there is none."""
        from switchyard import telemetry

        if meter is None:
            if not telemetry.metrics_enabled():
                return None
            meter = metrics.get_meter("switchyard.executor")

        def observe_load(options: CallbackOptions) -> Iterable[Observation]:
            in_flight, depth = load()
            return [
                Observation(in_flight, {"backend": backend, "kind": "in_flight"}),
                Observation(depth, {"backend": backend, "kind": "queue_depth"}),
            ]

        def observe_compilations(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(n, {"backend": backend, "model": m}) for m, n in compilations().items()]

        meter.create_observable_gauge("switchyard.executor.load", [observe_load], unit="{request}")
        meter.create_observable_gauge(
            "switchyard.executor.compilations_after_warmup", [observe_compilations], unit="{compilation}"
        )
        return cls(
            backend=backend,
            latency_us=meter.create_histogram("switchyard.executor.request.duration", unit="us"),
            queue_us=meter.create_histogram("switchyard.executor.queue.duration", unit="us"),
            compute_us=meter.create_histogram("switchyard.executor.compute.duration", unit="us"),
            batch_size=meter.create_histogram("switchyard.executor.batch.size", unit="{request}"),
        )

    def record(self, model: str, latency_us: int, queue_us: int, compute_us: int, batch_size: int) -> None:
        attributes = {"backend": self.backend, "model": model}
        self.latency_us.record(latency_us, attributes)
        self.queue_us.record(queue_us, attributes)
        self.compute_us.record(compute_us, attributes)
        self.batch_size.record(batch_size, attributes)
