"""The trial worker: hosts TrialWorkflow and its activities on task queue `switchyard-trials`.

`build_worker` wires the activity classes to one shared `Connections` (dependency injection:
tests and `switchyard up` pass their own addresses). `ensure_search_attributes` registers
model / paths / verdict on the namespace so operators can filter trials in the UI; it is
idempotent and runs at worker start.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence
from typing import Any

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.worker import Worker

from switchyard.errors import FailedPrecondition
from workflows.activities.authorization import AuthorizationActivities
from workflows.activities.connections import Connections, WorkerConfig
from workflows.activities.path import PathActivities
from workflows.activities.trial_ledger import LedgerActivities
from workflows.generation.activities import GenerationActivities
from workflows.generation.measure import GenerationMeasurement
from workflows.spec.trial_io import TrialPayloadConverter
from workflows.temporal_codec import KEY_FILE_ENV, trial_converter
from workflows.temporal_link import TemporalLink
from workflows.tensor.comparison import ComparisonActivities
from workflows.tensor.performance import PerformanceActivities
from workflows.training.activities import TrainingActivities
from workflows.trial import SEARCH_ATTRIBUTES, TrialWorkflow

log = logging.getLogger(__name__)


async def ensure_search_attributes(client: Client, namespace: str = "default") -> None:
    """Register the trial's search attributes on the namespace if they are missing."""
    existing = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=namespace)
    )
    missing = {
        key.name: IndexedValueType.ValueType(key.indexed_value_type)
        for key in SEARCH_ATTRIBUTES
        if key.name not in existing.custom_attributes
    }
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=namespace, search_attributes=missing)
        )
        log.info("registered search attributes %s", ", ".join(sorted(missing)))


async def connect(link: TemporalLink) -> Client:
    """A client over `link` (TLS where set, the payload codec where a key file is named:
    workflows/temporal_link.py) whose workflows and activities carry OpenTelemetry spans
    (docs/architecture.md#observability); the spans go wherever the process's tracer provider
    sends them (none configured = no-op)."""
    from temporalio.contrib.opentelemetry import TracingInterceptor

    return await Client.connect(
        link.address,
        namespace=link.namespace,
        data_converter=link.converter(),
        tls=link.tls.config(),
        interceptors=[TracingInterceptor(always_create_workflow_spans=True)],
    )


def with_trial_converter(client: Client) -> Client:
    """The same connection, reading TrialWorkflow's input as the spec parser needs it
    (unknown top-level keys kept: workflows/spec/trial_io.py), its payload codec kept."""
    if client.data_converter.payload_converter_class is TrialPayloadConverter:
        return client
    config = client.config()
    config["data_converter"] = trial_converter(client.data_converter.payload_codec)
    return Client(**config)


def activities(connections: Connections) -> Sequence[Any]:
    path = PathActivities(connections)
    perf = PerformanceActivities(connections)
    training = TrainingActivities(connections)
    comparison = ComparisonActivities(connections)
    ledger = LedgerActivities(connections)
    authorization = AuthorizationActivities(connections)
    generation = GenerationActivities(connections)
    generation_load = GenerationMeasurement(connections)
    return [
        authorization.authorize_trial,
        path.describe_path,
        path.serving_config,
        path.prepare_path,
        path.run_inputs,
        comparison.compare_outputs,
        training.train_path,
        perf.measure_performance,
        perf.measure_interleaved,
        generation.run_generation,
        generation.compare_generation,
        generation_load.measure_generation,
        generation_load.measure_generation_interleaved,
        ledger.register_path,
        ledger.open_reservation,
        ledger.record_path_usage,
        ledger.close_path,
        ledger.economics,
        ledger.record_trial,
    ]


def build_worker(client: Client, connections: Connections, task_queue: str | None = None) -> Worker:
    return Worker(
        with_trial_converter(client),
        task_queue=task_queue or connections.config.task_queue,
        workflows=[TrialWorkflow],
        activities=activities(connections),
        max_concurrent_activities=16,
    )


async def run_worker(config: WorkerConfig) -> None:
    connections = Connections(config)
    if not config.codec_key_file and not connections.security.insecure:
        # grants and specs would sit in Temporal's history in clear (docs/security.md)
        raise FailedPrecondition(
            "the trial worker needs the payload codec's keys: set --codec-key-file or "
            f"{KEY_FILE_ENV} (docs/runbook.md makes one), or run insecure by name"
        )
    client = await connect(config.link())
    await ensure_search_attributes(client, config.namespace)
    worker = build_worker(client, connections)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(  # how it talks to executors, evaluator and metering, as every service says at start
        "trial worker on %s over %s, payloads %s, task queue %s (%s)",
        config.temporal,
        config.tls.describe(),
        "encrypted" if config.codec_key_file else "in clear (no codec key file)",
        config.task_queue,
        connections.security.describe(),
    )
    async with worker:
        await stop.wait()
        log.info("signal received: finishing in-flight activities")
    await connections.close()
