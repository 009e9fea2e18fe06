"""Tracing set-up from the standard OTEL_* variables: nothing by default, sampling, OTLP.

A tracer provider is process-global, so what installs one runs in a child process; the
parsing of the variables runs here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

from switchyard.telemetry import TelemetryConfig
from tests.conftest import ROOT


def test_nothing_is_exported_by_default() -> None:
    config = TelemetryConfig.from_env("switchyard-router", environ={})
    assert config.exporters == () and config.service_name == "switchyard-router"


def test_the_standard_variables_are_honoured() -> None:
    env = {
        "OTEL_TRACES_EXPORTER": "otlp,console",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "OTEL_SERVICE_NAME": "edge-router",
        "SWITCHYARD_TRACES": "none",  # the older name yields to the standard one
    }
    config = TelemetryConfig.from_env("switchyard-router", environ=env)
    assert config.exporters == ("otlp", "console")
    assert (config.otlp_endpoint, config.service_name) == ("http://collector:4317", "edge-router")
    assert (config.sampler, config.sampler_arg) == ("parentbased_traceidratio", 0.25)
    assert "ParentBased" in type(config.make_sampler()).__name__
    # an endpoint alone means OTLP; the older variable still works alone
    assert TelemetryConfig.from_env(
        "x", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}
    ).exporters == ("otlp",)
    assert TelemetryConfig.from_env("x", environ={"SWITCHYARD_TRACES": "console"}).exporters == ("console",)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER='jaeger'"),
        ({"SWITCHYARD_TRACES": "zipkin"}, "SWITCHYARD_TRACES='zipkin'"),
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER='sometimes'"),
        ({"OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG='2'"),
        ({"OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG='half'"),
    ],
)
def test_a_bad_value_names_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("'", ".")):
        TelemetryConfig.from_env("x", environ=env)


CHILD = """
import json, os
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context
from switchyard import telemetry

config = telemetry.TelemetryConfig.from_env("switchyard-test")
memory = InMemorySpanExporter()
provider = telemetry.setup(config, exporter=memory)
processors = [type(p).__name__ for p in provider._active_span_processor._span_processors]
exporters = [type(getattr(p, "span_exporter", None) or p._batch_processor._exporter).__name__
             for p in provider._active_span_processor._span_processors]
tracer = trace.get_tracer("t")
ids = set()
for _ in range(200):
    with tracer.start_as_current_span("root"):
        ids.add(telemetry.current_trace_id())
sampled_parent = set_span_in_context(NonRecordingSpan(SpanContext(
    0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))))
with tracer.start_as_current_span("child", context=sampled_parent):
    pass
names = [s.name for s in memory.get_finished_spans()]
print(json.dumps({"processors": processors, "exporters": exporters, "roots": names.count("root"),
                  "children": names.count("child"), "ids": len(ids) - ("" in ids),
                  "service": provider.resource.attributes["service.name"]}))
provider.shutdown()
"""


def _child(env: dict[str, str], script: str = CHILD) -> dict[str, Any]:
    """`script`'s last line (JSON), run in a child process under `env` and no other OTEL_*."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SWITCHYARD_TRACES"))}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_ratio_sampling_keeps_trace_ids_and_the_callers_decision() -> None:
    got = _child(
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",  # nobody there: spans are dropped
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.1",
            "OTEL_SERVICE_NAME": "edge",
        }
    )
    # OTLP goes through a batch processor (off the request path); the test's exporter after it
    assert got["processors"] == ["BatchSpanProcessor", "SimpleSpanProcessor"]
    assert got["exporters"] == ["OTLPSpanExporter", "InMemorySpanExporter"]
    assert 0 < int(str(got["roots"])) < 60  # about 20 of 200 root traces recorded
    assert got["ids"] == 200  # every request still has its own trace id (audit rows name it)
    assert got["children"] == 1  # a sampled caller's trace is recorded whatever the ratio
    assert got["service"] == "edge"


def test_console_is_a_debugging_switch_without_a_batch_thread() -> None:
    got = _child({"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "always_off"})
    assert got["processors"] == ["SimpleSpanProcessor", "SimpleSpanProcessor"]
    assert got["exporters"] == ["ConsoleSpanExporter", "InMemorySpanExporter"]
    assert got["roots"] == 0 and got["children"] == 0 and got["ids"] == 200


def test_a_service_started_with_otlp_tracing_runs_and_serves_its_metrics() -> None:
    """The Kubernetes configuration (OTLP to a collector, ratio sampling): the process must
    start and serve, not exit on a missing exporter package; and its /metrics parses."""
    from prometheus_client.parser import text_string_to_metric_families

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SWITCHYARD_TRACES"))}
    env = {
        **clean,
        "PYTHONPATH": str(ROOT),
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.01",
    }
    args = [sys.executable, "-m", "clients.cli", "evaluator", "serve", "--port", "0", "--metrics-port", "0"]
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("metrics on http://"), line
        url = line.split()[-1]
        import urllib.request

        text = urllib.request.urlopen(url, timeout=10).read().decode()
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"process_cpu_seconds", "process_resident_memory_bytes"} <= names
        assert proc.poll() is None
    finally:
        proc.terminate()  # may land before the server installs its handler: either exit is fine
        assert proc.wait(timeout=30) in (0, -15)


def test_the_images_install_what_the_manifests_configure() -> None:
    """The Kubernetes config exports traces over OTLP and every pod serves Prometheus metrics:
    the packages for both are dependencies of the project (the CPU, CUDA and control images
    install it under requirements/main.txt's pins) and pinned in the XLA and TPU images' files."""
    import tomllib

    import yaml

    config = yaml.safe_load((ROOT / "deploy" / "k8s" / "base" / "config.yaml").read_text())["data"]
    assert "otlp" in config["OTEL_TRACES_EXPORTER"].split(",")
    needed = (
        "opentelemetry-exporter-otlp-proto-grpc",
        "opentelemetry-instrumentation-grpc",
        "prometheus_client",
    )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    server = project["optional-dependencies"]["server"]  # what every service runs on
    for package in needed:
        assert any(d.startswith(package) for d in server), package
        for pins in ("main.txt", "xla.txt", "tpu.txt"):
            text = (ROOT / "requirements" / pins).read_text()
            assert f"\n{package}==" in text, f"{package} is not pinned in requirements/{pins}"
    for dockerfile in (ROOT / "deploy" / "docker").glob("*.Dockerfile"):
        text = dockerfile.read_text()
        assert "9090" in text, f"{dockerfile.name} does not expose the metrics port"
        if "requirements/main.txt" in text:  # installs the project: with the server extra
            assert re.search(r'"\.\[server,[a-z]+\]"', text), f"{dockerfile.name} lacks the server extra"
        else:
            assert "requirements/xla.txt" in text or "requirements/tpu.txt" in text, dockerfile.name


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "4bf92f3577b34da6a3ce929d0e0e4736"),
        (b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "4bf92f3577b34da6a3ce929d0e0e4736"),
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", ""),  # W3C: the invalid id
        ("00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01", ""),  # not hex
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-01", ""),  # no span id
    ],
)
def test_the_trace_id_of_metadata_is_a_valid_traceparents_only(value: str | bytes, expected: str) -> None:
    from switchyard import telemetry

    assert telemetry.trace_id_of_metadata([("user-agent", "x"), ("traceparent", value)]) == expected
    assert telemetry.trace_id_of_metadata(None) == ""


@pytest.mark.parametrize("sampler", ["always_on", "always_off", "traceidratio"])
@pytest.mark.parametrize("parent_based", [True, False])
def test_the_leaf_rule_decides_as_the_sampler_does(sampler: str, parent_based: bool) -> None:
    import random

    from opentelemetry import trace

    name = f"parentbased_{sampler}" if parent_based else sampler
    config = TelemetryConfig("t", "none", sampler=name, sampler_arg=0.3)
    sdk, rule = config.make_sampler(), config.sampling_rule()
    draw = random.Random(7)
    for _ in range(2000):
        trace_id = draw.getrandbits(128) or 1
        flags = trace.TraceFlags(draw.choice([0, trace.TraceFlags.SAMPLED]))
        caller = trace.SpanContext(trace_id, draw.getrandbits(64) or 1, is_remote=True, trace_flags=flags)
        under = trace.set_span_in_context(trace.NonRecordingSpan(caller))
        as_root = sdk.should_sample(None, trace_id, "m").decision.is_sampled()  # type: ignore[no-untyped-call]
        as_child = sdk.should_sample(under, trace_id, "m").decision.is_sampled()  # type: ignore[no-untyped-call]
        assert rule.samples(trace_id) == as_root, (name, trace_id)
        assert rule.samples(trace_id, flags.sampled) == as_child, (name, trace_id, flags)


@pytest.mark.parametrize(
    "traceparent",
    [
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03",  # other flag bits set
        " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\t",  # blanks around it
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-later",  # a later version's fields
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # version 00 has none
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # the forbidden version
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # the invalid trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # the invalid span id
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
        "00-4bf92f3577b34da6a3ce929d0e0e4736-01",  # no span id
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-" + "x" * 500,  # too long
    ],
)
def test_a_traceparent_is_read_as_the_propagator_reads_it(traceparent: str) -> None:
    from opentelemetry import propagate, trace

    from switchyard.telemetry import caller_of

    caller = trace.get_current_span(propagate.extract({"traceparent": traceparent})).get_span_context()
    expected = (caller.trace_id, caller.trace_flags.sampled) if caller.is_valid else None
    assert caller_of(traceparent) == expected


LEAF_CHILD = """
import json
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from switchyard import telemetry

memory = InMemorySpanExporter()
telemetry.setup(telemetry.TelemetryConfig.from_env("switchyard-test"), exporter=memory)
M = "/inference.GRPCInferenceService/ModelInfer"
made = recording = 0
for _ in range(2000):
    with telemetry.leaf_span(M, {}) as span:
        made += span is not None
        recording += span is not None and span.is_recording()
roots = len(memory.get_finished_spans())
memory.clear()
tid, sid = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
with telemetry.leaf_span(M, {"traceparent": f"00-{tid}-{sid}-01"}):
    pass
with telemetry.leaf_span(M, {"traceparent": f"00-{tid}-{sid}-00"}) as dropped:
    pass
child = memory.get_finished_spans()
print(json.dumps({"roots": roots, "made": made, "recording": recording,
                  "children": [[format(s.context.trace_id, "032x"), format(s.parent.span_id, "016x")]
                               for s in child], "dropped": dropped}))
"""


def test_a_leaf_span_is_made_only_where_it_is_sampled() -> None:
    got = _child(
        {
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
        },
        LEAF_CHILD,
    )
    # about a quarter of the roots (binomial sd 19) make a span, each one the SDK's sampler
    # records (the drawn trace id reached it); the others make none at all
    assert got["made"] == got["recording"] == got["roots"] and 400 < got["roots"] < 600, got
    assert got["children"] == [["4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"]]
    assert got["dropped"] is None


CALL_CHILD = """
import json
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from switchyard import telemetry

memory = InMemorySpanExporter()
telemetry.setup(telemetry.TelemetryConfig.from_env("switchyard-test"), exporter=memory)
M = "/inference.GRPCInferenceService/ModelInfer"
flags, recording = [], 0
for _ in range(2000):
    with telemetry.call_span(M, ()) as span:
        flags.append(telemetry.trace_parameters()["traceparent"].rsplit("-", 1)[1])
        recording += span.is_recording()
roots = len(memory.get_finished_spans())
memory.clear()
tid, sid = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
sent = {}
for name, metadata in {
    "sampled": (("traceparent", f"00-{tid}-{sid}-01"),),
    "unsampled": (("traceparent", f"00-{tid}-{sid}-00"),),
    "unsampled_state": (("traceparent", f"00-{tid}-{sid}-00"), ("tracestate", "vendor=x")),
}.items():
    with telemetry.call_span(M, metadata):
        sent[name] = telemetry.trace_parameters()
        sent[name + "_id"] = telemetry.current_trace_id()
print(json.dumps({"roots": roots, "recording": recording, "flags": sorted(set(flags)),
                  "unsampled_flags": flags.count("02"), "sent": sent,
                  "children": [format(s.parent.span_id, "016x") for s in memory.get_finished_spans()]}))
"""


def test_a_call_span_passes_on_its_trace_where_it_is_not_sampled() -> None:
    got = _child(
        {
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
        },
        CALL_CHILD,
    )
    # about a quarter of the roots recorded and exported; every other one still sends a
    # traceparent on, not sampled, so the calls it makes follow its decision
    assert got["recording"] == got["roots"] and 400 < got["roots"] < 600, got
    # (flags as the SDK sets them: 02 the random-trace-id bit of a root, 01 sampled)
    assert got["flags"] == ["02", "03"] and got["unsampled_flags"] == 2000 - got["roots"]
    tid, sid = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    sent = got["sent"]
    assert got["children"] == [sid]  # the sampled caller's call: a span, its child
    version, trace_id, span_id, flag = sent["unsampled"]["traceparent"].split("-")
    assert (version, trace_id, flag) == ("00", tid, "00") and span_id not in (sid, "0" * 16)
    assert sent["unsampled_id"] == tid and "tracestate" not in sent["unsampled"]
    # a caller's tracestate: the SDK's own dropped span, which keeps it
    assert sent["unsampled_state"]["tracestate"] == "vendor=x"
    assert sent["unsampled_state"]["traceparent"].startswith(f"00-{tid}-") and sent["sampled"]["traceparent"]


UNSAMPLED_CARRIER_CHILD = """
import json
from opentelemetry import baggage, context, propagate, trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from switchyard import telemetry

telemetry.setup(telemetry.TelemetryConfig.from_env("switchyard-test"), exporter=InMemorySpanExporter())
M = "/inference.GRPCInferenceService/ModelInfer"
tid, sid = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
calls = {"root": (), "unsampled_caller": (("traceparent", f"00-{tid}-{sid}-00"),),
         "unsampled_random_caller": (("traceparent", f"00-{tid}-{sid}-02"),)}


def both():
    carrier = {}
    propagate.inject(carrier)  # what OpenTelemetry's own propagators write
    return {"ours": telemetry.trace_parameters(), "otel": carrier,
            "span": type(trace.get_current_span()).__name__}


got = {}
for name, metadata in calls.items():
    with telemetry.call_span(M, metadata):
        got[name] = both()
        token = context.attach(baggage.set_baggage("tenant", "a"))
        got[name + "_baggage"] = both()
        context.detach(token)
propagate.set_global_textmap(TraceContextTextMapPropagator())  # OTEL_PROPAGATORS=tracecontext
with telemetry.call_span(M, ()):
    token = context.attach(baggage.set_baggage("tenant", "a"))
    got["tracecontext_only"] = both()
    context.detach(token)
print(json.dumps(got))
"""


def test_an_unsampled_calls_trace_parameters_are_what_the_propagators_write() -> None:
    """The router's fast path for an unsampled call (`trace_parameters` reading the traceparent
    its span kept) sends exactly what OpenTelemetry's propagators would, and where baggage or
    other propagators are in play it is their carrier."""
    got = _child(
        {
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0",  # no call sampled: every one takes the fast path
        },
        UNSAMPLED_CARRIER_CHILD,
    )
    for name, case in got.items():
        assert case["ours"] == case["otel"], name
        assert case["span"] == "_Unsampled", name
    assert list(got["root"]["ours"]) == ["traceparent"] and got["root"]["ours"]["traceparent"].endswith("-02")
    assert got["unsampled_caller"]["ours"]["traceparent"].startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    assert got["unsampled_caller"]["ours"]["traceparent"].endswith("-00")
    assert got["unsampled_random_caller"]["ours"]["traceparent"].endswith("-02")
    assert got["root_baggage"]["ours"]["baggage"] == "tenant=a"
    assert "baggage" not in got["tracecontext_only"]["ours"]
