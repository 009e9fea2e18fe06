"""The trial worker meters a trial's generation requests with their tokens: the performance
activity's usage events, as it sends them, reach a real metering service (SQLite), the ledger
reports cost per million output tokens for the trial's path, and the economics activity
hands the trial those figures."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import grpc
from temporalio.testing import ActivityEnvironment

from services.metering.metering_server import start_metering
from services.metering.money import round_half_up
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from switchyard.grpcio import ServerOptions
from tests.metering.metering_helpers import price_paths
from workflows.activities.connections import Connections, WorkerConfig
from workflows.activities.trial_ledger import LedgerActivities
from workflows.pipeline.types import EconomicsRequest, InputsPlan, PerformanceRequest, Target
from workflows.spec.trial_spec import PerformancePlan
from workflows.tensor.performance import _record, _Sample

T0 = 1_767_225_600_000_000


async def test_trial_usage_carries_prompt_and_output_tokens(tmp_path: Path) -> None:
    running = await start_metering(f"sqlite:///{tmp_path / 'ledger.db'}", ServerOptions(port=0))
    connections = Connections(WorkerConfig(metering=running.address))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = mgrpc.MeteringStub(channel)
            await price_paths(stub, "cpu", ["cpu-eager@h"], resource_class="c", since_us=T0)
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
            reservation = await stub.OpenReservation(
                mpb.OpenReservationRequest(
                    idempotency_key="t-gen/res", path="cpu-eager@h", start_unix_us=T0, trial_id="t-gen"
                )
            )
            await ActivityEnvironment().run(_record, connections, request, "generation", 1, 1, samples)
            report = await stub.CostReport(mpb.CostReportRequest(group_by=["path"], trial_id="t-gen"))
            # The trial's economics (what the report and verdict read): the reservation closed
            # after a second, its idle time shared to the requests, all of it generation.
            economics = await ActivityEnvironment().run(
                LedgerActivities(connections).economics,
                EconomicsRequest(target, reservation.reservation_id, T0, T0 + 1_000_000),
            )
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

    reserved = 1_000  # one second at 3.6 units an hour
    assert (economics.total_micros, economics.generation_micros) == (reserved, reserved)
    assert (economics.prompt_tokens, economics.output_tokens, economics.generation_jobs_completed) == (
        32,
        53,
        3,
    )
    assert economics.cost_per_completed_generation_job_micros == round_half_up(Fraction(reserved, 3))
    assert economics.cost_per_million_output_tokens_micros == round_half_up(Fraction(reserved * 10**6, 53))
    assert economics.cost_per_million_prompt_tokens_micros == round_half_up(Fraction(reserved * 10**6, 32))
