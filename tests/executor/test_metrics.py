"""Executor metrics (DESIGN §8) land in an OpenTelemetry reader with model and path attributes."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.executor.metrics import ExecutorMetrics


def _points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    assert data is not None
    found: dict[str, list[Any]] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found[metric.name] = list(metric.data.data_points)
    return found


def test_requests_batches_load_and_compilations_are_recorded() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    recorder = ExecutorMetrics.create(
        "cpu", lambda: (3, 2), lambda: {"mlp:1": 0, "tiny-lm:1": 1}, meter=provider.get_meter("test")
    )
    assert recorder is not None
    recorder.record("mlp", latency_us=900, queue_us=100, compute_us=700, batch_size=4)
    recorder.record("mlp", latency_us=1100, queue_us=300, compute_us=700, batch_size=4)
    points = _points(reader)
    (latency,) = points["switchyard.executor.request.duration"]
    assert (latency.count, latency.sum, dict(latency.attributes)) == (
        2,
        2000,
        {"backend": "cpu", "model": "mlp"},
    )
    (batch,) = points["switchyard.executor.batch.size"]
    assert batch.sum == 8
    load = {p.attributes["kind"]: p.value for p in points["switchyard.executor.load"]}
    assert load == {"in_flight": 3, "queue_depth": 2}
    compiled = {
        p.attributes["model"]: p.value for p in points["switchyard.executor.compilations_after_warmup"]
    }
    assert compiled == {"mlp:1": 0, "tiny-lm:1": 1}
