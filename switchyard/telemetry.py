"""OpenTelemetry tracing for every switchyard service: set-up from the standard `OTEL_*`
variables, and trace context over gRPC.

`setup(TelemetryConfig.from_env("switchyard-router"))` installs a tracer provider once per
process, from:

- `OTEL_TRACES_EXPORTER` (older name `SWITCHYARD_TRACES`): `otlp`, `console`, `none` or a
  comma list; default `otlp` when an OTLP endpoint is set, else `none`.
- `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`): the collector (gRPC).
- `OTEL_TRACES_SAMPLER`: `always_on`, `always_off`, `traceidratio`, `parentbased_always_on`
  (default), `parentbased_always_off`, `parentbased_traceidratio`; `OTEL_TRACES_SAMPLER_ARG`:
  the ratio of the `*traceidratio` samplers, 0 to 1 (default 1).
- `OTEL_SERVICE_NAME`: the service's name in traces (default `switchyard-router`, ...).

By default nothing is exported and no provider is installed: no span is created, no
RPC method is wrapped, and the hot path pays nothing. OTLP spans go through a batch span
processor (a background thread, off the request path); `console` prints each span as it
ends and is a debugging switch: printing a span per request costs a small service about a
third of its throughput. The documented production setting is OTLP with
`OTEL_TRACES_SAMPLER=parentbased_traceidratio` and `OTEL_TRACES_SAMPLER_ARG=0.01`: the caller's
sampling decision is kept, and one root trace in a hundred is recorded; trace ids are still
made and propagated for every request the router takes, so audit rows name them. Inference in
the executor starts no other span and reads no trace id, so a call there that is not sampled
makes no span at all (`leaf_span`).

With a provider installed, every RPC a service serves is a SERVER span: `traced` wraps each
servicer method once, where the servicer is added to its server (switchyard.grpcio), so no
server has an interceptor; inference traces itself (`ServerSpan`): a message of a
long-lived inference stream carries its trace context in its own parameters and is its own
span, since a stream's metadata is sent once. Outgoing calls are CLIENT spans through
opentelemetry-instrumentation-grpc (`client_interceptors`). The chain client -> router ->
executor -> metering is one trace.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import random
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import grpc
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace import sampling as samplers
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

EXPORTERS = ("otlp", "console", "none")
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
# Methods traced by hand (ServerSpan), not by `traced`: a stream's messages are spans of
# their own, and ModelInfer, the hot path, opens its span inside the method, without a
# wrapping coroutine per call.
STREAM_METHODS = ("ModelStreamInfer",)
HAND_TRACED_METHODS = (*STREAM_METHODS, "ModelInfer")


@dataclass(frozen=True)
class TelemetryConfig:
    service_name: str
    exporter: str = "none"  # comma list of EXPORTERS
    otlp_endpoint: str = ""
    sampler: str = "parentbased_always_on"
    sampler_arg: float = 1.0

    @property
    def exporters(self) -> tuple[str, ...]:
        return tuple(e for e in self.exporter.split(",") if e and e != "none")

    @classmethod
    def from_env(
        cls, service_name: str, default: str = "none", environ: Mapping[str, str] | None = None
    ) -> TelemetryConfig:
        """The standard OTEL_* variables (SWITCHYARD_TRACES is the older name of
        OTEL_TRACES_EXPORTER); a bad value is refused with the variable and its choices."""
        env = os.environ if environ is None else environ
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        variable = "OTEL_TRACES_EXPORTER" if env.get("OTEL_TRACES_EXPORTER") else "SWITCHYARD_TRACES"
        chosen = env.get(variable) or ("otlp" if endpoint else default)
        names = [e.strip().lower() for e in chosen.split(",") if e.strip()]
        for name in names:
            if name not in EXPORTERS:
                choices = ", ".join(EXPORTERS)
                raise ValueError(f"{variable}={chosen!r}: use one of {choices} (or a comma list)")
        sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
        if sampler not in SAMPLERS:
            raise ValueError(f"OTEL_TRACES_SAMPLER={sampler!r}: use one of {', '.join(SAMPLERS)}")
        arg_text = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        try:
            arg = float(arg_text) if arg_text else 1.0
        except ValueError:
            arg = -1.0
        if not 0.0 <= arg <= 1.0:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={arg_text!r}: give the sampled share, 0 to 1")
        return cls(
            env.get("OTEL_SERVICE_NAME") or service_name, ",".join(names) or "none", endpoint, sampler, arg
        )

    def make_sampler(self) -> samplers.Sampler:
        ratio = samplers.TraceIdRatioBased(self.sampler_arg)
        root: samplers.Sampler = {
            "always_on": samplers.ALWAYS_ON,
            "always_off": samplers.ALWAYS_OFF,
            "traceidratio": ratio,
        }.get(self.sampler.removeprefix("parentbased_"), ratio)
        return samplers.ParentBased(root) if self.sampler.startswith("parentbased_") else root

    def sampling_rule(self) -> SamplingRule:
        root = self.sampler.removeprefix("parentbased_")
        bound = {"always_on": ALL_TRACES, "always_off": 0}.get(
            root, samplers.TraceIdRatioBased.get_bound_for_rate(self.sampler_arg)
        )
        return SamplingRule(self.sampler.startswith("parentbased_"), bound)


ALL_TRACES = samplers.TraceIdRatioBased.TRACE_ID_LIMIT + 1


@dataclass(frozen=True)
class SamplingRule:
    """`make_sampler`'s decision, taken before any span object is made (`leaf_span`): a trace
    is sampled when the low 64 bits of its id are below `bound` (TraceIdRatioBased's rule;
    ALL_TRACES for always_on, 0 for always_off), except that under a parent, `parent_based`
    keeps the parent's decision (ParentBased's defaults for a remote parent)."""

    parent_based: bool
    bound: int

    def samples(self, trace_id: int, parent_sampled: bool | None = None) -> bool:
        """`parent_sampled`: the caller's flag (None: no caller; the trace id is then the
        call's own, else the caller's)."""
        if parent_sampled is not None and self.parent_based:
            return parent_sampled
        return trace_id & samplers.TraceIdRatioBased.TRACE_ID_LIMIT < self.bound


class DrawnIds(RandomIdGenerator):
    """The SDK's random ids, except that a root trace id drawn before its span started (to
    take the sampling decision, `leaf_span`) is the next trace id made on that thread."""

    def __init__(self) -> None:
        self._next = threading.local()

    def hand_over(self, trace_id: int) -> None:
        self._next.trace_id = trace_id

    def generate_trace_id(self) -> int:
        drawn: int = getattr(self._next, "trace_id", 0)
        if drawn:
            self._next.trace_id = 0
            return drawn
        return super().generate_trace_id()


def _otlp_exporter(endpoint: str) -> SpanExporter:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
            OTLPSpanExporter,
        )
    except ImportError as exc:
        raise RuntimeError(
            "OTEL_TRACES_EXPORTER=otlp needs the package opentelemetry-exporter-otlp-proto-grpc "
            "(pinned in requirements/main.txt and installed in the images); install it or set "
            "OTEL_TRACES_EXPORTER=none"
        ) from exc
    exporter: SpanExporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    return exporter


def setup(config: TelemetryConfig, exporter: SpanExporter | None = None) -> TracerProvider | None:
    """Install the process's tracer provider (once); returns it, or None when nothing is
    exported. `exporter` (tests) is added with a simple processor, so spans are there at once."""
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        if exporter is not None:
            current.add_span_processor(SimpleSpanProcessor(exporter))
        return current
    if not config.exporters and exporter is None:
        return None
    global _LEAF_SAMPLING
    ids = DrawnIds()
    provider = TracerProvider(
        resource=Resource.create({"service.name": config.service_name}),
        sampler=config.make_sampler(),
        id_generator=ids,
    )
    _LEAF_SAMPLING = (config.sampling_rule(), ids)
    for name in config.exporters:
        if name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(config.otlp_endpoint)))
        else:  # console: a debugging switch, each span printed as it ends
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def enabled() -> bool:
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def _not_health_nor(methods: Sequence[str]) -> Any:
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.any_of(filters.health_check(), *(filters.method_name(m) for m in methods)))


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """opentelemetry-instrumentation-grpc's client interceptors (a CLIENT span per call and
    the trace context in its metadata) when tracing is on; none otherwise."""
    if not enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    interceptors: list[grpc.aio.ClientInterceptor] = aio_client_interceptors(  # type: ignore[no-untyped-call]
        filter_=_not_health_nor(STREAM_METHODS)
    )
    return interceptors


Metadata = Sequence[tuple[str, str | bytes]]


def inject_metadata(metadata: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Add the current trace context (traceparent, tracestate) to outgoing gRPC metadata."""
    metadata.extend(trace_parameters().items())
    return metadata


def metadata_carrier(metadata: Any) -> dict[str, str]:
    """gRPC metadata as a propagation carrier (text values)."""
    return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in (metadata or ())}


def extract_context(metadata: Any) -> otel_context.Context:
    return propagate.extract(metadata_carrier(metadata))


def trace_parameters() -> dict[str, str]:
    """The current trace context (traceparent, tracestate) as a carrier for a message's own
    parameters: on a long-lived stream, metadata is sent once and cannot carry it per request.
    Under a call `call_span` did not sample (99 in 100 at the production setting), with the
    default propagators and no baggage, it is the traceparent that call's span keeps, which is
    what `propagate.inject` writes for it (tested), without the propagators' walk: 6 us a
    request in the router's hot path."""
    current = otel_context.get_current()
    span = trace.get_current_span(current)
    if (
        type(span) is _Unsampled
        and _default_propagation(propagate.get_global_textmap())
        and not baggage.get_all(current)
    ):
        return {"traceparent": span.traceparent}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


@functools.lru_cache(maxsize=4)
def _default_propagation(textmap: Any) -> bool:
    """Whether `textmap` is OpenTelemetry's default (OTEL_PROPAGATORS unset): W3C trace context,
    then W3C baggage, and nothing else."""
    parts = getattr(textmap, "_propagators", None)
    kinds = tuple(type(p) for p in parts) if isinstance(parts, (list, tuple)) else ()
    default = (TraceContextTextMapPropagator, W3CBaggagePropagator)
    return type(textmap) is CompositePropagator and kinds == default


@functools.lru_cache(maxsize=4)
def _tracer_of(provider: trace.TracerProvider) -> trace.Tracer:
    """The tracer of a provider, made once: `trace.get_tracer` builds a new one per call
    (about 10 us, a quarter of an unsampled request's tracing cost here)."""
    return provider.get_tracer("switchyard.grpc")


class ServerSpan:
    """One SERVER span named after the full method ("/pkg.Service/Method"), current from
    `with` to its end, parented on the caller's trace context (a Context, or a carrier of
    traceparent/tracestate); ERROR if the block raises. A class, not a generator-based
    context manager (nor the tracer's `start_as_current_span`, which nests two): each
    inference request opens one, and this costs about half as much (19-21 against 35-38 us
    a request, unsampled, on the loaded 2-core host). Attributes are built only where the
    span is recorded (1% at the production setting)."""

    __slots__ = ("_method", "_parent", "_span", "_token")

    def __init__(self, method: str, parent: otel_context.Context | Mapping[str, str]) -> None:
        self._method = method
        self._parent = parent if isinstance(parent, otel_context.Context) else propagate.extract(dict(parent))

    def __enter__(self) -> trace.Span:
        tracer = _tracer_of(trace.get_tracer_provider())
        span = tracer.start_span(
            self._method,
            context=self._parent,
            kind=SpanKind.SERVER,
            record_exception=False,
            set_status_on_exception=False,
        )
        if span.is_recording():
            service, _, name = self._method.lstrip("/").partition("/")
            span.set_attributes({"rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
        self._span = span
        self._token = otel_context.attach(trace.set_span_in_context(span))
        return span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if kind is not None:
            self._span.set_status(Status(StatusCode.ERROR, kind.__name__))
        self._end()

    def _end(self) -> None:
        otel_context.detach(self._token)
        self._span.end()


# The sampling rule and id generator of the provider `setup` installed (None: none installed
# by it, so `leaf_span` leaves every decision to the provider).
_LEAF_SAMPLING: tuple[SamplingRule, DrawnIds] | None = None
_NO_SPAN = contextlib.nullcontext()


class _RootSpan(ServerSpan):
    """A ServerSpan with no parent whose trace id was drawn, and kept, before it started."""

    __slots__ = ("_ids", "_trace_id")

    def __init__(self, method: str, parent: Mapping[str, str], ids: DrawnIds, trace_id: int) -> None:
        super().__init__(method, parent)
        self._ids, self._trace_id = ids, trace_id

    def __enter__(self) -> trace.Span:
        self._ids.hand_over(self._trace_id)
        return super().__enter__()


def leaf_span(method: str, carrier: Mapping[str, str]) -> contextlib.AbstractContextManager[Any]:
    """The SERVER span of a call that starts no other span and reads no trace id (inference
    in the executor), parented on the traceparent/tracestate of `carrier`: a ServerSpan where
    the provider's sampler records the call, and nothing at all where it does not, which at
    the production setting is 99 calls in 100. An unsampled ServerSpan still makes a span,
    a context and a trace id: about 7 us in a loop, and 30-40 us of CPU a call measured in a
    loaded executor (docs/performance.md). The decision is the sampler's own: a root call's
    trace id is drawn first, decided by the same rule, and given to its span."""
    if _LEAF_SAMPLING is None:
        return ServerSpan(method, carrier)
    rule, ids = _LEAF_SAMPLING
    traceparent = carrier.get("traceparent")
    caller = caller_of(traceparent) if traceparent else None
    if caller is not None:
        return ServerSpan(method, carrier) if rule.samples(*caller) else _NO_SPAN
    trace_id = random.getrandbits(128) or 1
    return _RootSpan(method, carrier, ids, trace_id) if rule.samples(trace_id) else _NO_SPAN


class _Unsampled(trace.NonRecordingSpan):
    """The span `_UnsampledSpan` makes current, with the traceparent W3C's propagator writes for
    it (version 00, its ids, its flags; its trace state is empty, so no tracestate)."""

    def __init__(self, context: trace.SpanContext) -> None:
        super().__init__(context)
        self.traceparent = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


class _UnsampledSpan:
    """What the SDK makes of a call its sampler drops, without the SDK: the NonRecordingSpan of a
    new span id in the call's trace, not sampled, current for the block, so the calls it makes
    carry that trace with the not-sampled flag (their `traceparent`), as they would under a
    dropped span. No span object of the SDK's, no sampler call, nothing ended."""

    __slots__ = ("_span", "_token")

    def __init__(self, trace_id: int, random_id: bool) -> None:
        # not sampled; the random-trace-id flag as the SDK sets it (a root's ids are random)
        flags = trace.TraceFlags(trace.TraceFlags.RANDOM_TRACE_ID if random_id else trace.TraceFlags.DEFAULT)
        context = trace.SpanContext(trace_id, random.getrandbits(64) or 1, is_remote=False, trace_flags=flags)
        self._span = _Unsampled(context)

    def __enter__(self) -> trace.Span:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        otel_context.detach(self._token)


def call_span(method: str, metadata: Any) -> contextlib.AbstractContextManager[Any]:
    """The SERVER span of a call that makes calls of its own (the router's inference, whose
    executor call carries its trace), parented on the `traceparent` of its gRPC metadata: a
    ServerSpan where the sampler records the call; where it does not (99 calls in 100 at the
    production setting), only the unsampled span context the SDK would make (`_UnsampledSpan`).
    The router's unsampled ServerSpan cost it about 10 us a request in a loop, and more under
    load (docs/performance.md). The decision is `leaf_span`'s, which is the sampler's own; a
    caller's `tracestate`, which a dropped span keeps, takes the SDK's path."""
    carrier = metadata_carrier(metadata)
    if _LEAF_SAMPLING is None or "tracestate" in carrier:
        return ServerSpan(method, carrier)
    rule, ids = _LEAF_SAMPLING
    traceparent = carrier.get("traceparent")
    caller = caller_of(traceparent) if traceparent else None
    if caller is not None and traceparent:
        if rule.samples(*caller):
            return ServerSpan(method, carrier)
        # the caller's random-trace-id flag is kept (its flags are characters 53-54)
        return _UnsampledSpan(caller[0], bool(int(traceparent[53:55], 16) & trace.TraceFlags.RANDOM_TRACE_ID))
    trace_id = random.getrandbits(128) or 1
    return (
        _RootSpan(method, carrier, ids, trace_id)
        if rule.samples(trace_id)
        else _UnsampledSpan(trace_id, True)
    )


_TRACEPARENT = TraceContextTextMapPropagator._TRACEPARENT_HEADER_FORMAT_RE
_TRACEPARENT_MAX = TraceContextTextMapPropagator._TRACEPARENT_MAXIMUM_LENGTH


def caller_of(traceparent: str) -> tuple[int, bool] | None:
    """The trace id and sampled flag of a W3C traceparent that OpenTelemetry's propagator
    accepts (its own pattern and checks), else None, as it then extracts no parent. Without
    the span context, trace state and Context that `propagate.extract` builds: 3.7 us a call
    in a loop, more than the rest of an unsampled leaf span's decision (`leaf_span`)."""
    match = _TRACEPARENT.search(traceparent) if len(traceparent) <= _TRACEPARENT_MAX else None
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if trace_id == "0" * 32 or span_id == "0" * 16 or version == "ff" or (version == "00" and rest):
        return None
    return int(trace_id, 16), bool(int(flags, 16) & trace.TraceFlags.SAMPLED)


# The codes that are the server's fault: a server span's status is ERROR for these only
# (OpenTelemetry's rule for gRPC servers, as opentelemetry-instrumentation-grpc applies it).
_SERVER_FAULTS = frozenset(
    (
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    )
)


class _CallSpan(ServerSpan):
    """The span of one call, parented on the `traceparent` of its metadata, ending with the
    call's gRPC status and the attributes opentelemetry-instrumentation-grpc gives one."""

    __slots__ = ("_context", "_metadata")

    def __init__(self, method: str, context: Any) -> None:
        self._context = context
        self._metadata: Metadata = context.invocation_metadata() or ()
        super().__init__(method, extract_context(self._metadata))

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self._span.is_recording():
            _record_call(self._span, self._context, self._metadata)
        self._end()


def traced(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """`behavior` (an RPC method: coroutine or async generator of request and context) as one
    SERVER span per call (`_CallSpan`); `behavior` itself where tracing is off or the method
    traces itself (HAND_TRACED_METHODS). Applied once, where a servicer is added to its
    server, instead of a server interceptor: grpc.aio does more work per call, in its poller
    thread, for every RPC of a server with any interceptor installed."""
    if not enabled() or method.rpartition("/")[2] in HAND_TRACED_METHODS:
        return behavior
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            with _CallSpan(method, context):
                async for item in behavior(request, context):
                    yield item

        return stream

    async def unary(request: Any, context: Any) -> Any:
        with _CallSpan(method, context):
            return await behavior(request, context)

    return unary


def _record_call(span: trace.Span, context: Any, metadata: Metadata) -> None:
    """The status (an abort's or a set code, read back from the context), the user agent and
    the peer, as the instrumentation records them."""
    code = context.code() or grpc.StatusCode.OK
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_FAULTS:
        span.set_status(Status(StatusCode.ERROR, f"{code}:{context.details() or ''}"))
    agent = next((v for k, v in metadata if k == "user-agent"), None)
    if agent is not None:
        span.set_attribute("rpc.user_agent", agent if isinstance(agent, str) else agent.decode())
    family, _, address = context.peer().split(",")[0].partition(":")
    if family in ("ipv4", "ipv6"):
        ip, _, port = address.rpartition(":")
        span.set_attributes({"net.peer.ip": unquote(ip), "net.peer.port": port})
        if ip in ("[::1]", "127.0.0.1"):
            span.set_attribute("net.peer.name", "localhost")


def current_trace_id() -> str:
    return _trace_id(trace.get_current_span())


def trace_id_of_metadata(metadata: Any) -> str:
    """The trace id of the W3C `traceparent` in gRPC metadata ("" when none, or malformed)."""
    return _trace_id(trace.get_current_span(extract_context(metadata)))


def _trace_id(span: trace.Span) -> str:
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""
