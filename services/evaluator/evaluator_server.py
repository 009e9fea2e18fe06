"""Starting the evaluator service: in-process (tests, `switchyard up`) or as `evaluator serve`."""

from __future__ import annotations

import dataclasses
import logging

from services.evaluator.evaluator_servicer import SERVICE_NAME, EvaluatorServicer
from switchyard import authz, tls
from switchyard.gen.switchyard.v1 import evaluator_pb2_grpc as pb_grpc
from switchyard.grpcio import RunningServer, ServerOptions, run_service, start_server, stop_signal

log = logging.getLogger(__name__)
DEFAULT_PORT = 8301


async def start_evaluator(options: ServerOptions) -> RunningServer:
    """Start the evaluator on `options` (port 0 picks a free port) and return the running server.
    With mTLS it answers the router and the trial worker only."""
    security = tls.resolve(options.security)
    guard = (
        None
        if security.insecure
        else authz.ServiceGuard(security, {}, (tls.ROUTER, tls.WORKER), None, "the evaluator")
    )
    options = dataclasses.replace(options, security=security, guard=guard)
    return await start_server(
        [(pb_grpc.add_EvaluatorServicer_to_server, EvaluatorServicer(), SERVICE_NAME)], options
    )


async def serve(options: ServerOptions) -> None:
    stop = stop_signal()  # before the address is announced: see stop_signal
    server = await start_evaluator(options)
    log.info("evaluator serving on %s (%s)", server.address, server.describe_security())
    await server.wait_for_signal(stop)


def run(options: ServerOptions) -> int:
    run_service(serve(options))
    return 0
