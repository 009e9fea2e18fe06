"""Prometheus metrics for every switchyard service, each on a port of its own.

A service's metrics are collectors that read counters the service keeps anyway (plain
integers on its event loop) when Prometheus scrapes: recording a request costs a few
additions, never a lock or a histogram bucket search on the request path. `serve` starts an
HTTP server on a daemon thread with a registry of the service's own (`GET /metrics`, the
Prometheus text format).

Ports: `--metrics-port` on each `serve` command, else `SWITCHYARD_METRICS_PORT`; 0 (the
default) takes a free port and logs it ("metrics on http://host:port/metrics"), -1 turns the
endpoint off. The Kubernetes manifests set fixed ports and the scrape annotations.

Counters are named as Prometheus and Triton name them: Triton's `nv_inference_*` on
executors (`services/executor/executor_metrics.py`), `switchyard_router_*` on the router and
`switchyard_metering_*` on metering. Counter families are exposed without a `_total`
suffix where Triton's own names have none, so dashboards written for Triton work unchanged.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString as _go_float

log = logging.getLogger(__name__)

METRICS_PORT_ENV = "SWITCHYARD_METRICS_PORT"


class Family:
    """One metric family built at scrape time: `add(labels, value)` per series."""

    def __init__(self, name: str, doc: str, kind: str, labels: Sequence[str]) -> None:
        self.metric = Metric(name, doc, kind)
        self.name = name
        self.labels = tuple(labels)

    def add(self, values: Sequence[str], value: float, suffix: str = "") -> None:
        self.metric.add_sample(self.name + suffix, dict(zip(self.labels, values, strict=True)), value)


def counter(name: str, doc: str, labels: Sequence[str]) -> Family:
    """A counter family whose samples carry exactly `name` (Triton's convention: no `_total`)."""
    return Family(name, doc, "counter", labels)


def gauge(name: str, doc: str, labels: Sequence[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


# Latency buckets in seconds: 100 us to 10 s, about three per decade.
LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class Histogram:
    """A histogram per label tuple, kept as plain lists: `observe` is a bisect and two
    additions on the caller's thread (the event loop), read at scrape time."""

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS_S) -> None:
        self.bounds = tuple(bounds)
        self.series: dict[tuple[str, ...], list[float]] = {}  # counts per bucket (+Inf), then sum

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        cells = self.series.get(labels)
        if cells is None:
            cells = self.series[labels] = [0.0] * (len(self.bounds) + 2)
        cells[bisect.bisect_left(self.bounds, value)] += 1
        cells[-1] += value

    def family(self, name: str, doc: str, labels: Sequence[str]) -> Metric:
        metric = Metric(name, doc, "histogram")
        for values, cells in list(self.series.items()):
            base = dict(zip(labels, values, strict=True))
            running = 0.0
            for bound, n in zip((*self.bounds, float("inf")), cells[:-1], strict=True):
                running += n
                le = "+Inf" if bound == float("inf") else repr(bound)
                metric.add_sample(name + "_bucket", {**base, "le": le}, running)
            metric.add_sample(name + "_count", base, running)
            metric.add_sample(name + "_sum", base, cells[-1])
        return metric


class CallbackCollector(Collector):
    """A collector whose families come from `collect_fn` at each scrape."""

    def __init__(self, collect_fn: Callable[[], Iterable[Any]]) -> None:
        self._collect = collect_fn

    def collect(self) -> Iterable[Metric]:
        for family in self._collect():
            yield family.metric if isinstance(family, Family) else family


_TYPES = {"unknown": "untyped", "info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram"}


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    text: str = _go_float(value)  # type: ignore[no-untyped-call]
    return text


def exposition(registry: CollectorRegistry) -> bytes:
    """The Prometheus text format (0.0.4), as prometheus_client writes it except that a
    counter is declared under the name its samples carry: Triton's `nv_inference_count`
    stays `nv_inference_count` (prometheus_client would declare `nv_inference_count_total`)."""
    out: list[str] = []
    for metric in registry.collect():
        name = metric.name
        if metric.type == "counter" and any(s.name == name + "_total" for s in metric.samples):
            name += "_total"
        doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {_TYPES.get(metric.type, metric.type)}\n")
        for sample in metric.samples:
            labels = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(sample.labels.items()))
            out.append(
                f"{sample.name}{{{labels}}} {_number(sample.value)}\n"
                if labels
                else f"{sample.name} {_number(sample.value)}\n"
            )
    return "".join(out).encode()


def _handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404, "metrics are at /metrics")
                return
            body = exposition(registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a scrape every few seconds is not news

    return Handler


@dataclass
class MetricsEndpoint:
    registry: CollectorRegistry
    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def metrics_port(flag: int | None) -> int:
    """The port from the command line, else SWITCHYARD_METRICS_PORT, else 0 (any free port);
    -1 = no endpoint."""
    if flag is not None:
        return flag
    text = os.environ.get(METRICS_PORT_ENV, "").strip()
    if not text:
        return 0
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"{METRICS_PORT_ENV}={text!r}: give a port number, 0 for any, -1 for none") from None
    if not -1 <= port <= 65535:
        raise ValueError(f"{METRICS_PORT_ENV}={port}: give a port number, 0 for any, -1 for none")
    return port


def serve(collectors: Iterable[Collector], host: str, port: int, service: str = "") -> MetricsEndpoint | None:
    """Serve the collectors' metrics, and the process's own (CPU, memory, file descriptors),
    on http://host:port/metrics (0 = any free port, -1 = none)."""
    if port < 0:
        return None
    registry = CollectorRegistry(auto_describe=False)
    for collector in (*collectors, ProcessCollector(registry=None), PlatformCollector(registry=None)):
        registry.register(collector)
    try:
        server = ThreadingHTTPServer((host, port), _handler(registry))
    except OSError as exc:
        raise OSError(
            f"cannot serve metrics on {host}:{port} ({exc.strerror}); pick another --metrics-port "
            "(0 = any free port, -1 = none)"
        ) from None
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    endpoint = MetricsEndpoint(registry, host, server.server_port, server, thread)
    log.info("%s metrics on %s", service or "service", endpoint.url)
    print(f"metrics on {endpoint.url}", flush=True)
    return endpoint


@contextlib.contextmanager
def serving(collectors: Iterable[Collector], host: str, flag: int | None, service: str) -> Iterator[None]:
    """`serve` for the length of a `with` block: `flag` is the `--metrics-port` value (None:
    $SWITCHYARD_METRICS_PORT, else any free port; -1: none); the endpoint closes on exit."""
    endpoint = serve(collectors, host, metrics_port(flag), service)
    try:
        yield
    finally:
        if endpoint is not None:
            endpoint.close()
