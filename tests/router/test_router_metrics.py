"""Each service's /metrics, parsed with prometheus_client's parser, agrees with the traffic.

Real metering (SQLite), a real executor and the router on port 0, each with its metrics
endpoint; a tritonclient caller with a team's key sends requests through the router. The
router counts them per route, path and team; the executor counts them under Triton's names;
metering counts the usage it ingested, with its lag. ModelStatistics through the router is
as complete as the executor's.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import tritonclient.grpc.aio as triton

from services.executor import executor_metrics
from services.executor.executor_server import RunningExecutor
from services.metering import metering_metrics
from services.router import router_metrics
from switchyard import metrics_endpoint as prometheus
from tests.conftest import ROOT
from tests.executor.test_metrics import scrape, series_names, value
from tests.router.conftest import Metering, RouterFactory, routes_config

pytestmark = pytest.mark.asyncio(loop_scope="session")

REQUESTS = 5


async def test_router_executor_and_metering_metrics_count_the_same_requests(
    metering: Metering, executors: list[RunningExecutor], make_router: RouterFactory
) -> None:
    key, _ = await metering.key("metrics-caller", team="team-metrics")
    executor = executors[0]
    cfg = routes_config({"a": executor.address}, {"mlp": {"policy": "pinned", "targets": ["a"]}})
    router = await make_router(cfg, metering.running.address)
    servicer = metering.running.servicer
    endpoints = [
        prometheus.serve([executor_metrics.collector(executor.executor)], "127.0.0.1", 0),
        prometheus.serve([router_metrics.collector(router.router)], "127.0.0.1", 0),
        prometheus.serve(
            [metering_metrics.collector(servicer.stats, servicer.write_queue_depth)], "127.0.0.1", 0
        ),
    ]
    urls = [e.url for e in endpoints if e is not None]
    client = triton.InferenceServerClient(router.address)
    try:
        before = [scrape(url) for url in urls]
        x = np.zeros((1, 64), np.float32)
        inp = triton.InferInput("x", [1, 64], "FP32")
        inp.set_data_from_numpy(x)
        auth = {"authorization": f"Bearer {key}"}
        for _ in range(REQUESTS):
            await client.infer("mlp", [inp], headers=auth)
        stats = (await client.get_inference_statistics("mlp", headers=auth, as_json=False)).model_stats[0]
        assert router.router.spool is not None
        assert await router.router.spool.drain(30)  # usage delivered to metering
        after = [scrape(url) for url in urls]
        exposed = {name for url in urls for name in series_names(url)}
    finally:
        await client.close()
        for endpoint in endpoints:
            if endpoint is not None:
                endpoint.close()

    def delta(i: int, family: str, **labels: str) -> float:
        return value(after[i], family, **labels) - (
            value(before[i], family, **labels) if family in before[i] else 0
        )

    executor_labels = {"model": "mlp", "version": "1", "backend": "cpu"}
    assert delta(0, "nv_inference_request_success", **executor_labels) == REQUESTS
    route = {"model": "mlp", "path": "cpu-a"}
    assert (
        delta(1, "switchyard_router_requests", **route, team="team-metrics", status="completed") == REQUESTS
    )
    assert (
        delta(
            1,
            "switchyard_router_request_duration_seconds",
            **route,
            __sample=("switchyard_router_request_duration_seconds_count"),
        )
        == REQUESTS
    )
    overhead_count = "switchyard_router_overhead_seconds_count"  # every answered request's own time
    assert delta(1, "switchyard_router_overhead_seconds", **route, __sample=overhead_count) == REQUESTS
    assert value(after[1], "switchyard_router_deployment_admitted", deployment="a", path="cpu-a") == 1
    assert value(after[1], "switchyard_router_spool_depth") == 0
    assert delta(2, "switchyard_metering_usage_events", outcome="accepted") >= REQUESTS
    lag_count = "switchyard_metering_ingest_lag_seconds_count"
    assert delta(2, "switchyard_metering_ingest_lag_seconds", __sample=lag_count) >= REQUESTS
    assert value(after[2], "switchyard_metering_write_queue_depth") == 0

    # ModelStatistics answered by the executor through the router, under the caller's name
    assert stats.name == "mlp" and stats.inference_stats.success.count >= REQUESTS
    s = stats.inference_stats
    assert s.success.ns > 0 and s.compute_input.ns > 0 and s.compute_infer.ns > 0 and s.compute_output.ns > 0
    assert stats.last_inference > 0 and stats.batch_stats

    # every series the Grafana dashboard queries is one these services expose
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "switchyard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {m for e in exprs for m in re.findall(r"\b((?:nv_inference|switchyard|process)_[a-z_]+)\b", e)}
    assert queried and queried - exposed == set()
