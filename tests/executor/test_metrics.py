"""An executor's Prometheus metrics (Triton's names and units) and its complete ModelStatistics.

A real executor (grpc.aio, port 0) answers tritonclient requests; its metrics endpoint is
scraped over HTTP and parsed with prometheus_client's parser, and the numbers must agree with
the requests sent and with ModelStatistics.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from typing import Any

import numpy as np
import tritonclient.grpc.aio as triton
from prometheus_client.parser import text_string_to_metric_families

from services.executor import executor_metrics as metrics
from services.executor.executor_server import RunningExecutor
from switchyard import metrics_endpoint as prometheus


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """family name -> {sorted labels (with the sample's own suffix as `__sample`) -> value}."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        series = found.setdefault(family.name, {})
        for sample in family.samples:
            labels = {**sample.labels, "__sample": sample.name}
            series[tuple(sorted(labels.items()))] = sample.value
    return found


def series_names(url: str) -> set[str]:
    """Series names as the text format carries them (what Prometheus stores)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and line[0] != "#"}


def value(found: dict[str, Any], family: str, **labels: str) -> float:
    """The sum of a family's samples whose labels include `labels` (no bucket samples)."""
    return sum(
        float(v)
        for key, v in found[family].items()
        if all(dict(key).get(k) == want for k, want in labels.items())
        and not dict(key)["__sample"].endswith(("_bucket", "_created"))
    )


async def _infer(client: triton.InferenceServerClient, rows: int) -> None:
    x = np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    await client.infer("mlp", [inp])


async def test_triton_metrics_and_statistics_count_what_was_served(executor: RunningExecutor) -> None:
    endpoint = prometheus.serve([metrics.collector(executor.executor)], "127.0.0.1", 0, "executor")
    assert endpoint is not None
    client = triton.InferenceServerClient(executor.address)
    batcher = executor.executor.find("mlp", "").batcher
    assert batcher is not None
    inline_before = batcher.counters.ran_inline
    try:
        before = scrape(endpoint.url)
        start_ms = time.time_ns() // 1_000_000
        await _infer(client, 1)
        await _infer(client, 3)
        await asyncio.gather(*(_infer(client, 1) for _ in range(6)))  # may batch together
        after = scrape(endpoint.url)
        inline_after = batcher.counters.ran_inline
        stats = (await client.get_inference_statistics("mlp", as_json=False)).model_stats[0]
    finally:
        await client.close()
        endpoint.close()

    labels = {"model": "mlp", "version": "1", "backend": "cpu"}

    def delta(family: str, **extra: str) -> float:
        return value(after, family, **labels, **extra) - value(before, family, **labels, **extra)

    assert delta("nv_inference_request_success") == 8
    assert delta("nv_inference_count") == 1 + 3 + 6  # rows
    executions = delta("nv_inference_exec_count")
    assert 1 + 1 + 1 <= executions <= 1 + 1 + 6
    batch_executions = sum(
        v - before["switchyard_inference_batch_executions"].get(k, 0.0)
        for k, v in after["switchyard_inference_batch_executions"].items()
        if dict(k)["model"] == "mlp"
    )
    assert batch_executions == executions
    # requests computed on the loop: as the batcher counted them, and among those answered
    assert delta("switchyard_inference_inline_requests") == inline_after - inline_before
    assert 0 <= delta("switchyard_inference_inline_requests") <= 8
    for family in (
        "nv_inference_request_duration_us",
        "nv_inference_compute_input_duration_us",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_compute_output_duration_us",
    ):
        assert delta(family) > 0, family
    assert delta("nv_inference_request_duration_us") >= delta("nv_inference_compute_infer_duration_us")
    assert value(after, "nv_inference_request_failure", **labels) == value(
        before, "nv_inference_request_failure", **labels
    )
    assert value(after, "nv_inference_pending_request_count", **labels) == 0
    assert value(after, "switchyard_compilations_after_warmup", **labels) == 0
    assert "process_cpu_seconds" in after  # the process's own metrics come along

    # ModelStatistics: the same counters, complete as Triton fills them
    s = stats.inference_stats
    assert s.success.count == value(after, "nv_inference_request_success", **labels)
    assert s.success.ns > 0 and s.queue.count == s.success.count
    assert s.compute_input.ns > 0 and s.compute_infer.ns > 0 and s.compute_output.ns > 0
    assert s.compute_infer.count == s.success.count
    assert stats.inference_count == value(after, "nv_inference_count", **labels)
    assert stats.execution_count == value(after, "nv_inference_exec_count", **labels)
    assert stats.last_inference >= start_ms
    sizes = {b.batch_size: b for b in stats.batch_stats}
    assert 3 in sizes and 1 in sizes
    assert sum(b.compute_infer.count for b in stats.batch_stats) == stats.execution_count
    assert all(b.compute_infer.ns > 0 for b in stats.batch_stats)
