"""The records the router's stages share, beneath all of them: what became of a request
(`Outcome`), who it is charged to (`Charge`), and the ports a stage is handed instead of
another stage (`CopySender`, `UsageRecorder`).

The stages (`admission`, `route_table`, `forwarder`, `usage_meter`, `shadow_mirror`) import
this module and never each other; `request_path` is the only module that knows them all and
puts them in order.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from services.router import wire
from services.router.auth import Identity
from services.router.router_config import Route, Target
from switchyard.gen.inference import grpc_service_pb2 as pb


@dataclass
class Outcome:
    """What became of one request (or shadow copy), filled in as it goes."""

    status: str = "failed"
    path: str = ""
    busy_us: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class Charge:
    """Who a request is charged to, and since when."""

    route: Route
    identity: Identity
    request_id: str
    header: wire.Header
    started_us: int


def now_us() -> int:
    return time.time_ns() // 1000


class CopySender(Protocol):
    """Sends a copy of a request to one given target, no plan and no retry (the forwarder)."""

    def path_of(self, target: Target) -> str:
        """The accelerator path of the target's deployment."""
        ...

    async def forward_copy(
        self, target: Target, header: wire.Header, raw: bytes, timeout_s: float, outcome: Outcome
    ) -> bytes: ...

    def stream_on(
        self, target: Target, header: wire.Header, raw: bytes, timeout_s: float, outcome: Outcome
    ) -> AsyncIterator[pb.ModelInferResponse]: ...


class UsageRecorder(Protocol):
    """Records one usage event (the usage meter)."""

    def record(
        self, charge: Charge, outcome: Outcome, arm: str = "primary", tags: dict[str, str] | None = None
    ) -> None: ...
