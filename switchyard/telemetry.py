"""OpenTelemetry for every switchyard service: set-up, and trace context over gRPC metadata.

`setup(TelemetryConfig.from_env("router"))` installs a tracer and a meter provider once per
process: console exporter by default (metrics every 60 s), OTLP when `SWITCHYARD_TRACES=otlp`
(or `OTEL_EXPORTER_OTLP_ENDPOINT` is set; the OTLP exporter package must then be installed),
nothing with `none`. `switchyard.grpcio.start_server` adds `ServerTracingInterceptor` whenever
a tracer provider is installed, so each served RPC is a span whose parent comes from the
caller's `traceparent` metadata; callers add their context with `inject_metadata` or
`ClientTracingInterceptor`. The chain router -> executor -> metering is therefore one trace.
Without a provider nothing is wrapped and the hot path pays nothing."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

EXPORTERS = ("console", "otlp", "none")


@dataclass(frozen=True)
class TelemetryConfig:
    service_name: str
    exporter: str = "console"
    otlp_endpoint: str = ""

    @classmethod
    def from_env(cls, service_name: str, default: str = "console") -> TelemetryConfig:
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        exporter = os.environ.get("SWITCHYARD_TRACES", "otlp" if endpoint else default).lower()
        if exporter not in EXPORTERS:
            raise ValueError(f"SWITCHYARD_TRACES={exporter!r}: use one of {EXPORTERS}")
        return cls(service_name, exporter, endpoint)


def _otlp_exporter(endpoint: str) -> SpanExporter:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
            OTLPSpanExporter,
        )
    except ImportError as exc:
        raise RuntimeError(
            "SWITCHYARD_TRACES=otlp needs the package opentelemetry-exporter-otlp-proto-grpc "
            "(not in the pinned environment); install it or use SWITCHYARD_TRACES=console"
        ) from exc
    exporter: SpanExporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    return exporter


def _setup_metrics(config: TelemetryConfig, reader: MetricReader | None) -> None:
    if isinstance(metrics.get_meter_provider(), MeterProvider):
        return
    if reader is None:
        if config.exporter == "none":
            return
        if config.exporter == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (  # type: ignore[import-not-found,unused-ignore]
                    OTLPMetricExporter,
                )
            except ImportError:
                return  # traces already said what to install
            reader = PeriodicExportingMetricReader(OTLPMetricExporter())
        else:
            reader = PeriodicExportingMetricReader(ConsoleMetricExporter(), export_interval_millis=60_000)
    resource = Resource.create({"service.name": config.service_name})
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=[reader]))


def metrics_enabled() -> bool:
    return isinstance(metrics.get_meter_provider(), MeterProvider)


def setup(
    config: TelemetryConfig, exporter: SpanExporter | None = None, metric_reader: MetricReader | None = None
) -> TracerProvider | None:
    """Install the process's tracer and meter providers (once); returns the tracer provider or None."""
    _setup_metrics(config, metric_reader)
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        if exporter is not None:
            current.add_span_processor(BatchSpanProcessor(exporter))
        return current
    if config.exporter == "none" and exporter is None:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
    if exporter is None:
        exporter = (
            _otlp_exporter(config.otlp_endpoint) if config.exporter == "otlp" else ConsoleSpanExporter()
        )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def enabled() -> bool:
    return isinstance(trace.get_tracer_provider(), TracerProvider)


Metadata = Sequence[tuple[str, str | bytes]]


def inject_metadata(metadata: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Add the current trace context (traceparent, tracestate) to outgoing gRPC metadata."""
    metadata.extend(trace_parameters().items())
    return metadata


def extract_context(metadata: Any) -> otel_context.Context:
    carrier = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in (metadata or ())}
    return propagate.extract(carrier)


def trace_parameters() -> dict[str, str]:
    """The current trace context (traceparent, tracestate) as a carrier for a message's own
    parameters: on a long-lived stream, metadata is sent once and cannot carry it per request."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


@contextlib.contextmanager
def server_span(method: str, parent: otel_context.Context | Mapping[str, str]) -> Iterator[None]:
    """One SERVER span for an RPC or one message of a stream, parented on the caller's trace
    context (a Context, or a carrier of traceparent/tracestate)."""
    if not isinstance(parent, otel_context.Context):
        parent = propagate.extract(dict(parent))
    tracer = trace.get_tracer("switchyard.grpc")
    with tracer.start_as_current_span(
        method, context=parent, kind=SpanKind.SERVER, record_exception=False
    ) as span:
        span.set_attribute("rpc.system", "grpc")
        span.set_attribute("rpc.method", method)
        try:
            yield
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise


def current_trace_id() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


class ServerTracingInterceptor(grpc.aio.ServerInterceptor):
    """One SERVER span per unary RPC, parented on the caller's `traceparent` metadata."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        behavior: Callable[..., Any] = handler.unary_unary
        method = details.method
        parent = extract_context(details.invocation_metadata)

        async def traced(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            with server_span(method, parent):
                return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            traced,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class ClientTracingInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds a CLIENT span and the trace context to every unary call of a channel."""

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        method = client_call_details.method
        name = method.decode() if isinstance(method, bytes) else str(method)
        with trace.get_tracer("switchyard.grpc").start_as_current_span(name, kind=SpanKind.CLIENT):
            metadata = inject_metadata(list(client_call_details.metadata or ()))  # type: ignore[arg-type]
            details = grpc.aio.ClientCallDetails(
                client_call_details.method,
                client_call_details.timeout,
                grpc.aio.Metadata(*metadata),
                client_call_details.credentials,
                client_call_details.wait_for_ready,
            )
            return await continuation(details, request)
