"""The trial worker meters a trial's generation requests with their tokens: the performance
activity's usage events, as it sends them, reach a real metering service (SQLite) and the
ledger reports cost per million output tokens for the trial's path."""

from __future__ import annotations

from pathlib import Path

import grpc
from temporalio.testing import ActivityEnvironment

from services.metering.metering_server import start_metering
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from switchyard.grpcio import ServerOptions
from workflows.connections import Connections, WorkerConfig
from workflows.performance import PerformanceActivities, _Sample
from workflows.spec import PerformancePlan
from workflows.types import InputsPlan, PerformanceRequest, Target

T0 = 1_767_225_600_000_000


async def test_trial_usage_carries_prompt_and_output_tokens(tmp_path: Path) -> None:
    running = await start_metering(f"sqlite:///{tmp_path / 'ledger.db'}", ServerOptions(port=0))
    connections = Connections(WorkerConfig(metering=running.address))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = mgrpc.MeteringStub(channel)
            await stub.SetPrice(
                mpb.SetPriceRequest(
                    price_key="cpu", micros_per_hour=3_600_000, currency="USD", effective_from_unix_us=T0
                )
            )
            await stub.RegisterPath(
                mpb.RegisterPathRequest(
                    path="cpu-eager@h", backend="cpu", resource_class="c", price_key="cpu"
                )
            )
            target = Target(
                trial_id="t-gen", path="cpu-eager", executor="e", model="llama-tiny", version="1",
                checkpoint_sha256="", mode="eager", precision="fp32", batch_buckets=[1],
                ledger_path="cpu-eager@h", team="search",
            )  # fmt: skip
            request = PerformanceRequest(
                target, InputsPlan(seed=0, tensors=[]), PerformancePlan(), met_quality=True
            )
            samples = [
                _Sample(T0 + i * 10_000, T0 + i * 10_000 + 5_000, 0.005, 1_000 * (i + 1), True, 8, 16 + i)
                for i in range(3)
            ]
            samples.append(_Sample(T0 + 90_000, T0 + 95_000, 0.005, 500, False, 8, 2))  # failed after 2
            acts = PerformanceActivities(connections)
            await ActivityEnvironment().run(acts._record, request, "generation", 1, 1, samples)
            report = await stub.CostReport(mpb.CostReportRequest(group_by=["path"], trial_id="t-gen"))
    finally:
        await connections.close()
        await running.stop(0.5)
    (row,) = report.rows
    assert (row.prompt_tokens, row.output_tokens) == (32, 16 + 17 + 18 + 2)
    assert (row.generation_jobs_completed, row.generation_jobs_total) == (3, 4)
    # 1 micro-unit per busy millisecond: 1 + 2 + 3 + 1 (0.5 rounded half up) over 53 output tokens
    assert row.generation_micros == row.total_micros == 7
    assert row.cost_per_million_output_tokens_micros == (7 * 10**6 * 2 + 53) // (2 * 53)
    assert row.cost_per_completed_generation_job_micros == 2  # 7 / 3, rounded half up
