"""Load for fault tests: real gRPC clients of a router's public port that count every answer
they receive (its request id, and when) and every error, so "answers received" is exact and a
test can hold the ledger to it, inside a fault's window or not."""

from __future__ import annotations

import asyncio
import time

import grpc

from switchyard.gen.inference import grpc_service_pb2_grpc as pbgrpc
from tests.router.test_router_faults import _request


class CountedClients:
    def __init__(self, address: str, key: str, clients: int, call_timeout_s: float) -> None:
        self.address, self.metadata = address, [("authorization", f"Bearer {key}")]
        self.clients, self.call_timeout_s = clients, call_timeout_s
        self.answers: list[tuple[float, str]] = []  # (monotonic time, request id)
        self.errors: list[tuple[float, str]] = []  # (monotonic time, status name)
        self.stop = asyncio.Event()

    @property
    def answered(self) -> list[str]:
        return [rid for _, rid in self.answers]

    async def run(self, max_requests: int, timeout_s: float) -> None:
        """`clients` callers until `stop`, bounded in count as well as in time."""
        sent = iter(range(max_requests))
        request = _request()

        async def one_client() -> None:
            async with grpc.aio.insecure_channel(self.address) as channel:
                stub = pbgrpc.GRPCInferenceServiceStub(channel)
                for _ in sent:
                    if self.stop.is_set():
                        return
                    try:
                        reply = await stub.ModelInfer(
                            request, metadata=self.metadata, timeout=self.call_timeout_s
                        )
                    except grpc.aio.AioRpcError as exc:
                        self.errors.append((time.monotonic(), exc.code().name))
                        await asyncio.sleep(0.02)  # the router or its upstream is down: do not spin
                    else:
                        self.answers.append((time.monotonic(), reply.parameters["request_id"].string_param))

        await asyncio.wait_for(asyncio.gather(*(one_client() for _ in range(self.clients))), timeout_s)

    async def until(self, answers: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.answers) < answers:
            assert time.monotonic() < deadline, f"only {len(self.answers)} answers in {timeout_s}s"
            await asyncio.sleep(0.01)
