"""Operator commands: `switchyard worker` and `switchyard trial start|status|report|cancel`.

Registration is cheap (temporalio and the workflow modules are imported inside the command
functions). Addresses come from flags, else from SWITCHYARD_TEMPORAL, SWITCHYARD_EVALUATOR,
SWITCHYARD_METERING and SWITCHYARD_EXECUTORS ("cpu=127.0.0.1:8101,xla=127.0.0.1:8102").
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

_ON = ("1", "true", "yes")


def _executors(text: str, hosts: dict[str, str] | None = None) -> dict[str, str]:
    """NAME=HOST:PORT[@HOSTID],... ; the optional host id overrides the executor's own."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, address = item.partition("=")
        address, _, host = address.partition("@")
        if not sep or not name or ":" not in address:
            raise argparse.ArgumentTypeError(
                f"executor {item!r}: write NAME=HOST:PORT[@HOSTID], e.g. cpu=127.0.0.1:8101"
            )
        out[name] = address
        if host and hosts is not None:
            hosts[name] = host
    return out


def _worker(args: argparse.Namespace) -> int:
    import asyncio

    from clients.trial_commands import link_of
    from switchyard import metrics_endpoint, telemetry
    from workflows.activities.connections import WorkerConfig
    from workflows.worker import run_worker

    # before the Temporal client connects: its TracingInterceptor uses this provider
    telemetry.setup(telemetry.TelemetryConfig.from_env("switchyard-worker"))

    hosts: dict[str, str] = {}
    executors = _executors(os.environ.get("SWITCHYARD_EXECUTORS", ""), hosts)
    for item in args.executor or []:
        executors.update(_executors(item, hosts))
    link = link_of(args)
    config = WorkerConfig(
        temporal=args.temporal,
        namespace=args.namespace,
        evaluator=args.evaluator,
        metering=args.metering,
        executors=executors,
        task_queue=args.task_queue,
        hosts=hosts,
        ui_key=_ui_key(args.ui_key_file),
        tls=link.tls,
        codec_key_file=link.codec_key_file,
    )
    host = os.environ.get("SWITCHYARD_METRICS_HOST", "127.0.0.1")  # the worker serves nothing else
    with metrics_endpoint.serving([], host, args.metrics_port, "worker"):
        asyncio.run(run_worker(config))
    return 0


def _ui_key(path: str) -> str:
    """The UI principal's API key from `path` ("" for none); the file holds the key alone."""
    if not path:
        return ""
    try:
        key = Path(path).read_text().strip()
    except OSError as err:
        raise SystemExit(f"--ui-key-file {path}: {err.strerror}; name a file holding one API key") from None
    if not key:
        raise SystemExit(f"--ui-key-file {path} is empty; write the UI principal's API key into it")
    return key


def _trial(args: argparse.Namespace) -> int:
    from clients import trial_commands
    from switchyard import telemetry

    # a started trial's trace begins here when tracing is configured (OTEL_* variables)
    telemetry.setup(telemetry.TelemetryConfig.from_env("switchyard-trial"))

    return trial_commands.main(args)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--temporal",
        default=os.environ.get("SWITCHYARD_TEMPORAL", "127.0.0.1:7233"),
        help="Temporal frontend (default SWITCHYARD_TEMPORAL or 127.0.0.1:7233)",
    )
    parser.add_argument("--namespace", default="default", help="Temporal namespace (default: default)")
    _temporal_tls(parser)
    parser.add_argument(
        "--metering",
        default=os.environ.get("SWITCHYARD_METERING", "127.0.0.1:8201"),
        help="metering address (default SWITCHYARD_METERING or 127.0.0.1:8201)",
    )


# The Temporal connection's files and names: flag, its environment variable, metavar, help.
_TEMPORAL_FLAGS = (
    ("--temporal-tls-ca", "SWITCHYARD_TEMPORAL_TLS_CA", "PEM", "CA of Temporal's certificate; turns TLS on"),
    ("--temporal-tls-cert", "SWITCHYARD_TEMPORAL_TLS_CERT", "PEM", "client certificate for Temporal's mTLS"),
    ("--temporal-tls-key", "SWITCHYARD_TEMPORAL_TLS_KEY", "PEM", "its key"),
    (
        "--temporal-tls-server-name",
        "SWITCHYARD_TEMPORAL_TLS_SERVER_NAME",
        "NAME",
        "name Temporal's certificate carries",
    ),
    (
        "--codec-key-file",
        "SWITCHYARD_TEMPORAL_CODEC_KEY_FILE",
        "PATH",
        "keys of the payload codec that encrypts what Temporal stores; none: payloads in clear",
    ),
)


def _temporal_tls(parser: argparse.ArgumentParser) -> None:
    """TLS to Temporal and the payload codec's keys (workflows/temporal_link.py)."""
    env = os.environ.get
    parser.add_argument(
        "--temporal-tls",
        action="store_true",
        default=env("SWITCHYARD_TEMPORAL_TLS", "").lower() in _ON,
        help="TLS to Temporal with the system's CAs (default SWITCHYARD_TEMPORAL_TLS; on when a CA is named)",
    )
    for flag, variable, metavar, text in _TEMPORAL_FLAGS:
        parser.add_argument(
            flag, default=env(variable, ""), metavar=metavar, help=f"{text} (default {variable})"
        )


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Adds `worker` and `trial`."""
    worker = sub.add_parser("worker", help="run the trial worker (TrialWorkflow and its activities)")
    _common(worker)
    worker.add_argument(
        "--evaluator",
        default=os.environ.get("SWITCHYARD_EVALUATOR", "127.0.0.1:8301"),
        help="evaluator address (default SWITCHYARD_EVALUATOR or 127.0.0.1:8301)",
    )
    worker.add_argument(
        "--executor",
        action="append",
        metavar="NAME=HOST:PORT[@HOSTID]",
        help="an executor the spec may name (repeatable); @HOSTID overrides the host it reports",
    )
    worker.add_argument(
        "--task-queue", default="switchyard-trials", help="task queue (default switchyard-trials)"
    )
    worker.add_argument(
        "--ui-key-file",
        default=os.environ.get("SWITCHYARD_TRIAL_UI_KEY_FILE", ""),
        metavar="PATH",
        help="file holding the API key a trial started without a grant (Temporal UI or "
        "`temporal workflow start`) runs as; its principal needs trials:run on the model "
        "(default SWITCHYARD_TRIAL_UI_KEY_FILE; none: such trials are refused)",
    )
    worker.add_argument("--metrics-port", type=int, default=None)  # help: clients.cli_help
    worker.set_defaults(func=_worker)

    trial = sub.add_parser("trial", help="start, watch, cancel trials and fetch their reports")
    commands = trial.add_subparsers(dest="trial_command", required=True, metavar="COMMAND")
    start = commands.add_parser("start", help="validate SPEC.json and start a TrialWorkflow")
    start.add_argument("spec", help="trial spec (JSON file; see docs/trial-spec.md)")
    start.add_argument("--id", default="", help="workflow id (default trial-<model>-<random>)")
    start.add_argument("--wait", action="store_true", help="show live progress and wait for the verdicts")
    start.add_argument(
        "--task-queue", default="switchyard-trials", help="task queue (default switchyard-trials)"
    )
    status = commands.add_parser("status", help="progress of a running trial, or its verdicts")
    status.add_argument("trial_id")
    report = commands.add_parser("report", help="the stored report as HTML, Markdown or JSON")
    report.add_argument("trial_id")
    report.add_argument("-o", "--output", default="-", help="file to write (default stdout)")
    report.add_argument(
        "--format", choices=("html", "md", "json"), default="", help="default: from -o suffix, else md"
    )
    report.add_argument(
        "--source",
        choices=("ledger", "temporal"),
        default="ledger",
        help="where to read it (default the ledger)",
    )
    cancel = commands.add_parser(
        "cancel", help="cancel a trial (closes its reservations, records it cancelled)"
    )
    cancel.add_argument("trial_id")
    cancel.add_argument("--reason", default="cancelled by operator")
    for parser in (start, status, report, cancel):
        _common(parser)
        parser.set_defaults(func=_trial)
