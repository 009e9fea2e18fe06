"""Inference traffic for the main job: a team, its key, and requests through the router.

Everything goes through the public interfaces a real team uses: the metering service's
access API for the principal, role and key, and `tritonclient.grpc` against the router with
`authorization: Bearer <key>`. Inputs are built from the router's ModelMetadata, so the job
works for any model a route serves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from clients.local_cluster.principal_keys import create_principal_key
from switchyard.gen.switchyard.v1 import metering_pb2

# Inputs with an unknown (-1) dimension get this size: batch 1, and sequences at the length
# the executors warm up with (tiny-lm's DEFAULT_SEQ, 32): the XLA path compiles per shape, so
# any other length would compile while serving (and be reported as such).
DYNAMIC_DIM = {0: 1}
DEFAULT_SEQ = 32  # = switchyard.models.tiny_lm.DEFAULT_SEQ (tested), without importing torch here
TOKEN_RANGE = 64  # token ids stay inside every reference model's vocabulary


@dataclass(frozen=True)
class TeamKey:
    principal_id: str
    team: str
    key_id: str
    key: str  # the full bearer secret; shown once, never logged


async def create_team_key(
    metering: str, team: str, models: Sequence[str] = ("*",), trials: Sequence[str] = ()
) -> TeamKey:
    """A team principal with the `infer` role (on `models`), `trials:run` on `trials`, and a
    fresh API key."""
    grants = [("infer", "*" if model == "*" else f"model:{model}") for model in models]
    grants += [("trials:run", f"model:{model}") for model in trials]
    actor = metering_pb2.Actor(principal="admin", source="switchyard demo")
    made = await create_principal_key(metering, team, grants, actor, kind="team", team=team)
    return TeamKey(made.principal_id, team, made.key_id, made.key)


@dataclass
class TrafficResult:
    model: str
    sent: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    answered_by: dict[str, int] = field(default_factory=dict)
    router_overhead_us: list[int] = field(default_factory=list)
    wall_s: float = 0.0

    def p(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else 0.0

    def overhead_p50_us(self) -> float:
        return float(np.percentile(self.router_overhead_us, 50)) if self.router_overhead_us else 0.0


def _input_array(dims: Sequence[int], datatype: str, rng: np.random.Generator) -> np.ndarray:
    shape = [d if d > 0 else DYNAMIC_DIM.get(i, DEFAULT_SEQ) for i, d in enumerate(dims)]
    if datatype in ("INT64", "INT32"):
        return rng.integers(0, TOKEN_RANGE, size=shape).astype(np.int64 if datatype == "INT64" else np.int32)
    if datatype == "FP16":
        return rng.standard_normal(shape).astype(np.float16)
    if datatype == "FP64":
        return rng.standard_normal(shape)
    if datatype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.standard_normal(shape).astype(np.float32)


async def send_requests(
    router: str, key: str, model: str, count: int, concurrency: int = 8, seed: int = 0
) -> TrafficResult:
    """`count` ModelInfer calls with random inputs shaped by ModelMetadata, `concurrency` at once."""
    import tritonclient.grpc.aio as triton  # control env only; imported on use
    from tritonclient.utils import InferenceServerException

    headers = {"authorization": f"Bearer {key}"}
    client = triton.InferenceServerClient(url=router)
    result = TrafficResult(model)
    rng = np.random.default_rng(seed)
    try:
        meta = await client.get_model_metadata(model, headers=headers)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(count):
            queue.put_nowait(i)

        async def one(i: int) -> None:
            inputs = []
            for spec in meta.inputs:
                array = _input_array(list(spec.shape), spec.datatype, rng)
                tensor = triton.InferInput(spec.name, list(array.shape), spec.datatype)
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            start = time.perf_counter()
            result.sent += 1
            try:
                reply = await client.infer(
                    model, inputs, headers=headers, request_id=f"demo-{seed}-{i}", client_timeout=30
                )
            except InferenceServerException as exc:
                status = str(exc.status() or "error")
                result.errors[status] = result.errors.get(status, 0) + 1
                return
            result.latencies_ms.append((time.perf_counter() - start) * 1000)
            result.ok += 1
            # The router says which path answered and what its own hop cost (response parameters).
            params = reply.get_response().parameters
            path = params["path"].string_param if "path" in params else "?"
            result.answered_by[path] = result.answered_by.get(path, 0) + 1
            if "router_overhead_us" in params:
                result.router_overhead_us.append(int(params["router_overhead_us"].int64_param))

        async def worker() -> None:
            while not queue.empty():
                await one(queue.get_nowait())

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.wall_s = time.perf_counter() - began
    finally:
        await client.close()
    return result
