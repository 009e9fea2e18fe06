"""The `switchyard` command: one entry point whose subcommands live with the clients.

Every process starts through it (`switchyard executor serve`, `switchyard up`, ...), so it stays
in the shared package; the commands themselves are operator-side code in `clients/*_cli.py`.

Each module in COMMAND_MODULES has `register(subparsers)`, which adds its subcommands and
sets `func` (taking the parsed args, returning an exit code). Registration must stay cheap:
heavy imports (torch, sqlalchemy, temporalio) happen inside the command functions, so the
CLI also starts in the XLA environment, which has only the executor's dependencies.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

COMMAND_MODULES = (
    "clients.executor_cli",
    "services.executor.backends.detect",
    "clients.infer_cli",
    "clients.metering_cli",
    "clients.paths_cli",
    "clients.evaluator_cli",
    "clients.router_cli",
    "clients.trial_cli",
    "clients.local_cluster.cluster_cli",
    "clients.models_cli",
    "clients.workloads_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description=__doc__.splitlines()[0])
    from switchyard import __version__

    parser.add_argument("--version", action="version", version=f"switchyard {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", help="logging level: DEBUG, INFO, WARNING or ERROR (default INFO)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    from clients import cli_help

    cli_help.complete(parser)  # shared help (with units) and examples where a module gave none
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from switchyard.errors import SwitchyardError

    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except SwitchyardError as exc:
        # an expected refusal (e.g. a backend unavailable here): its message, not a traceback
        print(f"switchyard {args.command}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        import grpc

        if isinstance(exc, grpc.Call):  # a service's answer: its status and message
            print(f"switchyard {args.command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
