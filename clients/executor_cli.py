"""`switchyard executor serve|describe`: run an executor process, or describe a running one.

Registration is cheap; torch and grpc are imported inside the command functions.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from services.executor.executor_config import GENERATION_ENGINES
from switchyard import net


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser("executor", help="run or inspect an executor (one accelerator path)")
    commands = parser.add_subparsers(dest="executor_command", required=True, metavar="SUBCOMMAND")

    serve = commands.add_parser("serve", help="serve models on one backend over OIP gRPC")
    _what_it_serves(serve.add_argument_group("what it serves, and how"))
    _where_it_listens(serve.add_argument_group("where it listens, and who may call"))
    serve.set_defaults(func=_serve)

    describe = commands.add_parser("describe", help="print an executor's Describe as JSON")
    describe.add_argument("--address", default="127.0.0.1:8101")
    describe.set_defaults(func=_describe)


def _what_it_serves(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--backend", default="cpu", help="cpu | cuda | xla | tpu (default cpu)")
    group.add_argument(
        "--models", default="mlp", help="comma-separated models to load at start (name[:version])"
    )
    group.add_argument(
        "--model-repository",
        default="",
        help="the model repository to load from (default $SWITCHYARD_MODELS_REPOSITORY or var/models; "
        "a missing folder is created and seeded with the built-ins)",
    )
    group.add_argument(
        "--allow-factory",
        action="append",
        default=[],
        metavar="PACKAGE",
        help="a package whose factory-format models may be imported (repeatable; none by default)",
    )
    group.add_argument("--mode", default="", help="execution mode (default: the backend's first)")
    group.add_argument("--precision", default="fp32", help="fp32 | bf16 | fp16 | fp64")
    group.add_argument("--buckets", default="1,2,4,8", help="batch buckets warmed at load")
    group.add_argument("--max-queue-delay-us", type=int, default=0)
    group.add_argument("--max-queue-size", type=int, default=64)
    group.add_argument("--no-batching", action="store_true", help="run every request alone")
    group.add_argument("--price-key", default="")
    group.add_argument(
        "--inline-compute-us",
        type=int,
        default=10_000,
        help="a lone request on a quiet executor expected to compute within this many "
        "microseconds runs on the event loop instead of the device thread",
    )
    group.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: cores - 1)")
    group.add_argument(
        "--generation-engine",
        choices=GENERATION_ENGINES,
        default="process",
        help="on cpu, a causal LM's generation engine runs in a process of its own (default) or "
        "on the executor's device thread",
    )


def _where_it_listens(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument(
        "--port",
        type=int,
        default=-1,
        help="TCP port to serve on (default: 8101 cpu, 8102 xla, 8103 cuda, 8104 tpu)",
    )
    group.add_argument(
        "--frames-port",
        type=int,
        default=0,
        help="port for routers' framed inference on the same host (default 0: any free port, "
        "reported by Describe; -1: off, routers then use gRPC streams)",
    )
    group.add_argument("--max-message-mb", type=int, default=net.MAX_MESSAGE_BYTES // net.MIB)
    group.add_argument("--metrics-port", type=int, default=None)  # help: clients.cli_help
    group.add_argument(
        "--metering",
        default=os.environ.get("SWITCHYARD_METERING", ""),
        help="metering address, where refused calls are audited (default SWITCHYARD_METERING, else log only)",
    )
    group.add_argument(
        "--oip-identities",
        default="router,worker",
        help="with mTLS: services that may call inference here directly (default router,worker)",
    )


def _serve(args: argparse.Namespace) -> int:
    from switchyard import transport

    transport.prefer_low_latency()  # before anything imports grpc
    if loads_a_causal_lm(args):  # its engine's interpreter imports beside this one's imports
        from services.executor.generation import engine_launch

        engine_launch.prestart()
    from services.executor import executor_metrics as metrics
    from services.executor.executor_config import DEFAULT_PORTS, ExecutorConfig
    from services.executor.executor_server import start_executor
    from switchyard import metrics_endpoint as prometheus
    from switchyard import telemetry
    from switchyard.grpcio import run_service, stop_signal

    # traces per the OTEL_* variables (none by default), before the server starts so its
    # tracing interceptor is installed
    telemetry.setup(telemetry.TelemetryConfig.from_env("switchyard-executor"))
    metrics_port = prometheus.metrics_port(args.metrics_port)  # a bad value fails before the start

    config = ExecutorConfig(
        backend=args.backend,
        host=args.host,
        port=args.port if args.port >= 0 else DEFAULT_PORTS.get(args.backend, 8101),
        frames_port=args.frames_port,
        models=tuple(m.strip() for m in args.models.split(",") if m.strip()),
        model_repository=str(_repository(args.model_repository)),
        allowed_factories=tuple(p for arg in args.allow_factory for p in arg.split(",") if p),
        mode=args.mode,
        precision=args.precision,
        batch_buckets=tuple(int(b) for b in args.buckets.split(",")),
        max_queue_delay_us=args.max_queue_delay_us,
        max_queue_size=args.max_queue_size,
        dynamic_batching=not args.no_batching,
        max_message_bytes=args.max_message_mb * net.MIB,
        price_key=args.price_key,
        cpu_threads=args.threads,
        inline_compute_us=args.inline_compute_us,
        generation_engine=args.generation_engine,
        metering=args.metering,
        oip_identities=tuple(i.strip() for i in args.oip_identities.split(",") if i.strip()),
    )

    async def run() -> None:
        stop = stop_signal()  # before the address is announced: see stop_signal
        running = await start_executor(config)
        with prometheus.serving([metrics.collector(running.executor)], args.host, metrics_port, "executor"):
            # Models and modules loaded at start-up live as long as the process: keep them out
            # of the cyclic collector's full passes, which would otherwise walk them while serving.
            import gc

            gc.collect()
            gc.freeze()
            print(f"executor {running.executor.executor_id} serving on {running.address}", flush=True)
            await running.serve_until_signal(stop)

    run_service(run())
    return 0


def loads_a_causal_lm(args: argparse.Namespace) -> bool:
    """Whether one of --models is a causal LM whose engine will run in a process of its own
    (its model.toml has [generation]); a model.toml that cannot be read counts as not (its
    load reports it)."""
    if args.backend != "cpu" or args.generation_engine != "process":
        return False
    from switchyard.models.manifest import ManifestError, read_model_toml

    root = _repository(args.model_repository)
    for entry in args.models.split(","):
        name = entry.strip().partition(":")[0]
        try:
            if name and read_model_toml(root / name, name=name).generation:
                return True
        except (ManifestError, OSError):
            continue
    return False


def _repository(given: str) -> Path:
    """The repository folder; a missing one is created with the built-ins in it."""
    import os

    from switchyard.models.builtins import seed_builtins

    root = Path(given or os.environ.get("SWITCHYARD_MODELS_REPOSITORY", "") or "var/models").resolve()
    if not root.exists():
        seed_builtins(root)
    return root


def _describe(args: argparse.Namespace) -> int:
    import json

    from clients.executor_client import ExecutorClient

    with ExecutorClient(args.address) as client:
        print(json.dumps(client.describe(), indent=2, sort_keys=True))
    return 0
