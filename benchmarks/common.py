"""What several benchmarks share: scratch PostgreSQL databases, the JSON report, the usage
event the ledger benchmarks record, and the hand-written minimal OIP server that executor
benchmarks compare against."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine

ROOT = Path(__file__).resolve().parent.parent
PG_HOST = "postgresql+psycopg://postgres@127.0.0.1:5432"


@contextlib.contextmanager
def postgres_databases(prefix: str, count: int) -> Iterator[list[str] | None]:
    """`count` new, uniquely named databases on the local PostgreSQL as URLs, dropped
    afterwards (other suites share the server); None, with a printed notice, when the server
    cannot be reached: reachable or not is reported, never hidden."""
    names = [f"{prefix}_{uuid.uuid4().hex[:8]}" for _ in range(count)]
    admin = create_engine(f"{PG_HOST}/test", isolation_level="AUTOCOMMIT")
    try:
        try:
            with admin.connect() as conn:
                for name in names:
                    conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        except Exception as exc:
            print(f"NOTICE: PostgreSQL not reachable, skipped ({exc.__class__.__name__})")
            yield None
            return
        try:
            yield [f"{PG_HOST}/{name}" for name in names]
        finally:
            with admin.connect() as conn:
                for name in names:
                    conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def request_usage(path: str, model: str, team: str, principal: str, busy_us: int) -> dict[str, Any]:
    """The fields of the usage event the router sends for a completed request that met its
    quality bar (named alike on the message and on services.metering.records.UsageEvent),
    but for its key and times: what the ledger benchmarks record."""
    done = {"kind": "request", "status": "completed", "met_quality": True, "arm": "primary"}
    return dict(done, path=path, model=model, team=team, principal=principal, busy_us=busy_us)


def write_report(name: str, report: Any) -> Path:
    """out/bench/<name>.json, announced."""
    out = ROOT / "out" / "bench" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return out


async def serve_minimal_oip(spec: Any) -> None:
    """A minimal grpc.aio OIP server for one model (a registry ModelSpec): decode, run the
    module inline, encode. No batching, no limits, no health; prints "serving on HOST:PORT"."""
    import grpc
    import torch

    from switchyard import codec
    from switchyard.gen.inference import grpc_service_pb2 as oip
    from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc
    from switchyard.models.registry import load_module

    module = load_module(spec)

    class Minimal(oip_grpc.GRPCInferenceServiceServicer):
        async def ModelInfer(self, request: oip.ModelInferRequest, context: Any) -> oip.ModelInferResponse:
            tensors = [
                codec.to_torch(codec.decode(i.name, i.datatype, i.shape, raw).array, i.datatype)
                for i, raw in zip(request.inputs, request.raw_input_contents, strict=True)
            ]
            with torch.inference_mode():
                out = module(*tensors)
            datatype, raw = codec.encode_torch(out)
            response = oip.ModelInferResponse(model_name=spec.name, id=request.id)
            response.outputs.add(name=spec.outputs[0].name, datatype=datatype, shape=out.shape)
            response.raw_output_contents.append(raw)
            return response

    server = grpc.aio.server()
    oip_grpc.add_GRPCInferenceServiceServicer_to_server(Minimal(), server)  # type: ignore[abstract]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"serving on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()
