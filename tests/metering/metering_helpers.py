"""Builders shared by the ledger tests (plain functions: no fixtures, no mocks)."""

from __future__ import annotations

import grpc
import pytest

from switchyard.gen.switchyard.v1 import metering_pb2 as pb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc

HOUR = 3_600_000_000
T0 = 1_767_225_600_000_000  # 2026-01-01T00:00:00Z


async def setup_path(
    stub: pb_grpc.MeteringAsyncStub,
    path: str = "cpu-eager@h1",
    key: str = "cpu-std",
    per_hour: int = 3_600_000,
) -> None:
    await stub.SetPrice(
        pb.SetPriceRequest(
            price=pb.Price(price_key=key, micros_per_hour=per_hour, currency="USD", effective_from_unix_us=T0)
        )
    )
    await stub.RegisterPath(
        pb.RegisterPathRequest(
            path_info=pb.PathInfo(path=path, backend="cpu", resource_class="cpu-16", price_key=key)
        )
    )


def event(key: str, start: int, busy: int, path: str = "cpu-eager@h1", **kw: object) -> pb.UsageEvent:
    fields: dict[str, object] = dict(model="mlp", team="search", status="completed", met_quality=True)
    fields.update(ended_unix_us=start + max(busy, 0))
    fields.update(kw)
    return pb.UsageEvent(idempotency_key=key, path=path, busy_us=busy, started_unix_us=start, **fields)  # type: ignore[arg-type]


async def expect_status(call: object, code: grpc.StatusCode, fragment: str = "") -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == code, info.value.details()
    details = info.value.details() or ""
    assert fragment in details, details
    return details
