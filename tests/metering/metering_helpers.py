"""Builders shared by the ledger tests (plain functions: no fixtures, no mocks)."""

from __future__ import annotations

from collections.abc import Iterable

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
    await price_paths(stub, key, [path], per_hour=per_hour)


async def price_paths(
    stub: pb_grpc.MeteringAsyncStub,
    key: str,
    paths: Iterable[str],
    *,
    per_hour: int = 3_600_000,
    resource_class: str = "cpu-16",
    since_us: int = T0,
    actor: pb.Actor | None = None,
) -> None:
    """Price `key` in USD per hour from `since_us` (0 = now), then register each of `paths`
    (backend cpu) at that key: what a ledger needs before it can charge usage."""
    price = pb.Price(price_key=key, micros_per_hour=per_hour, currency="USD", effective_from_unix_us=since_us)
    await stub.SetPrice(pb.SetPriceRequest(price=price, actor=actor))
    for path in paths:
        info = pb.PathInfo(path=path, backend="cpu", resource_class=resource_class, price_key=key)
        await stub.RegisterPath(pb.RegisterPathRequest(path_info=info, actor=actor))


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
