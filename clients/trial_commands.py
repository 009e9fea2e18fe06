"""The operator side of trials: start (with a live progress bar), status, report, cancel.

A spec is validated here first, so a typo is reported before anything starts; the workflow
validates again (the Temporal UI does not pass through this command).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import grpc
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.service import RPCError

from switchyard import tls
from workflows.activities.authorization import GRANT_MEMO, request_grant
from workflows.report.render import criteria_in_order, line_of, render
from workflows.spec.trial_io import TrialInput, TrialReport
from workflows.spec.trial_spec import SpecError, parse_spec
from workflows.temporal_link import TemporalLink, TemporalLinkError, TemporalTLS
from workflows.trial import TrialWorkflow
from workflows.worker import connect

BAR = 30
SEAL_HINT = "name the payload codec's keys: --codec-key-file or SWITCHYARD_TEMPORAL_CODEC_KEY_FILE"
SEAL_NEEDED = f"trial not started: its grant and spec would reach Temporal in clear; {SEAL_HINT}"


def _bar(progress: dict[str, Any]) -> str:
    filled = int(BAR * progress.get("percent", 0) / 100)
    paths = ", ".join(f"{n}: {p['phase']}/{p['status']}" for n, p in progress.get("paths", {}).items())
    return f"[{'#' * filled}{'.' * (BAR - filled)}] {progress.get('percent', 0):5.1f}% {paths}"


def link_of(args: argparse.Namespace) -> TemporalLink:
    """How this command reaches Temporal (workflows/temporal_link.py), from its flags."""
    try:
        security = TemporalTLS.of(
            args.temporal_tls_ca,
            args.temporal_tls_cert,
            args.temporal_tls_key,
            args.temporal_tls_server_name,
            on=args.temporal_tls,
        )
    except TemporalLinkError as err:
        raise SystemExit(str(err)) from None
    return TemporalLink(args.temporal, args.namespace, security, args.codec_key_file)


async def _activity_details(client: Client, handle: WorkflowHandle[Any, Any]) -> str:
    """What the running activities last reported in their heartbeats (e.g. requests measured)."""
    desc = await handle.describe()
    parts = []
    for pending in desc.raw_description.pending_activities:
        if not pending.heartbeat_details.payloads:
            continue
        details = (await client.data_converter.decode(pending.heartbeat_details.payloads))[0]
        if isinstance(details, dict) and "scenario" in details:
            parts.append(
                f"{details.get('path')}: {details['scenario']} b{details.get('batch')} "
                f"{details.get('done', 0)}/{details.get('target')}"
            )
        elif isinstance(details, dict) and "phase" in details:
            parts.append(f"{details.get('path', '')}: {details['phase']} {details.get('elapsed_s', '')}s")
    return "; ".join(parts)


async def _watch(
    client: Client, handle: WorkflowHandle[Any, TrialReport], out: Any = sys.stderr
) -> dict[str, Any]:
    """Redraw the progress line until the workflow ends (to a file or pipe: a new line
    whenever it changes), then show the final one; return the workflow's result."""
    result_task = asyncio.ensure_future(handle.result())
    last = ""

    async def show(with_details: bool) -> None:
        nonlocal last
        try:
            progress = await handle.query(TrialWorkflow.progress, rpc_timeout=timedelta(seconds=10))
            line = _bar(progress)
            details = await _activity_details(client, handle) if with_details else ""
        except RPCError:
            return  # no worker has picked the workflow up yet, or none is left to answer
        if details:
            line += f" | {details}"
        if out.isatty():
            out.write("\r" + line[:160].ljust(160))
        elif line != last:
            out.write(line + "\n")
        last = line
        out.flush()

    while not result_task.done():
        await show(with_details=True)
        await asyncio.wait({result_task}, timeout=0.5)
    await show(with_details=False)  # the final state: every path's last phase
    if out.isatty():
        out.write("\n")
    report: dict[str, Any] = result_task.result().to_json()
    return report


def _summary(report: dict[str, Any]) -> str:
    lines = [f"trial {report['trial_id']}: {report['status']}"]
    for path, v in report["verdicts"].items():
        lines.append(f"  {path}: {line_of(v)}")
        lines += [f"    {name}: {c['result']}: {c['reason']}" for name, c in criteria_in_order(v)]
    return "\n".join(lines)


async def _start(args: argparse.Namespace) -> int:
    text = await asyncio.to_thread(Path(args.spec).read_text)
    try:
        spec_json = json.loads(text)
    except json.JSONDecodeError as exc:
        print(f"{args.spec}: not JSON: {exc}", file=sys.stderr)
        return 2
    try:
        spec = parse_spec(spec_json)
    except SpecError as err:
        print(f"{args.spec}: invalid trial spec: {err}", file=sys.stderr)
        return 2
    workflow_id = args.id or f"trial-{spec.model.name}-{uuid.uuid4().hex[:8]}"
    link = link_of(args)
    if not link.codec_key_file and not tls.current().insecure:
        print(SEAL_NEEDED, file=sys.stderr)  # the grant would sit in Temporal's memo in clear
        return 2
    try:  # the roles the spec needs (workflows/authorization.needs), before anything starts
        grant = await request_grant(
            args.metering, spec, workflow_id, os.environ.get("SWITCHYARD_API_KEY", "")
        )
    except grpc.aio.AioRpcError as err:
        print(f"trial not started: {err.code().name}: {err.details()}", file=sys.stderr)
        return 2 if err.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED) else 1
    client = await connect(link)
    handle = await client.start_workflow(
        TrialWorkflow.run,
        TrialInput.from_json(spec_json),
        id=workflow_id,
        task_queue=args.task_queue,
        memo={GRANT_MEMO: grant} if grant else None,
    )
    print(f"started {workflow_id}")
    if not args.wait:
        return 0
    report = await _watch(client, handle)
    print(_summary(report))
    return 0


async def _status(args: argparse.Namespace) -> int:
    client = await connect(link_of(args))
    handle = client.get_workflow_handle(args.trial_id)
    desc = await handle.describe()
    if desc.status == WorkflowExecutionStatus.RUNNING:
        try:
            print(_bar(await handle.query(TrialWorkflow.progress)))
        except RPCError as err:
            why = f"no worker answered the progress query ({err.message})"
            print(f"trial {args.trial_id}: running, but {why}; is a trial worker polling its task queue?",
                  file=sys.stderr)  # fmt: skip
            return 1
    elif desc.status == WorkflowExecutionStatus.COMPLETED:
        print(_summary(await handle.result()))
    elif desc.status == WorkflowExecutionStatus.FAILED:
        try:
            await handle.result()
        except WorkflowFailureError as err:
            cause = err.cause
            print(f"trial {args.trial_id}: FAILED: {getattr(cause, 'message', None) or cause}")
            return 1
    else:
        print(f"trial {args.trial_id}: {desc.status.name if desc.status else 'unknown'}")
    return 0


async def _report(args: argparse.Namespace) -> int:
    fmt = args.format or {".html": "html", ".json": "json"}.get(Path(args.output).suffix, "md")
    if args.source == "ledger":
        from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
        from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc

        async with tls.aio_channel(args.metering, expect=tls.METERING) as channel:
            stored = await mgrpc.MeteringStub(channel).GetTrialReport(
                mpb.GetTrialReportRequest(trial_id=args.trial_id), timeout=30
            )
        if not stored.report_json:
            print(
                f"trial {args.trial_id} is {stored.status}; "
                + (
                    "it was refused before it measured: `switchyard trial status ID` says why"
                    if stored.status == "failed"
                    else "its report is written when it ends"
                ),
                file=sys.stderr,
            )
            return 1
        report = json.loads(stored.report_json)
    else:
        client = await connect(link_of(args))
        report = await client.get_workflow_handle(args.trial_id).result()
    text = render(report, fmt)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        await asyncio.to_thread(Path(args.output).write_text, text)
        print(f"wrote {args.output} ({fmt})")
    return 0


async def _cancel(args: argparse.Namespace) -> int:
    client = await connect(link_of(args))
    handle = client.get_workflow_handle(args.trial_id)
    status = await handle.execute_update(TrialWorkflow.cancel, args.reason)
    print(f"trial {args.trial_id}: {status}")
    return 0


async def _main(args: argparse.Namespace) -> int:
    command = {"start": _start, "status": _status, "report": _report, "cancel": _cancel}[args.trial_command]
    try:
        return await command(args)
    except KeyError as err:  # the SDK's word for a payload no converter reads
        if "binary/encrypted" not in str(err):
            raise
        print(f"trial {getattr(args, 'trial_id', '')}: its payloads are sealed; {SEAL_HINT}", file=sys.stderr)
        return 2


def main(args: argparse.Namespace) -> NoReturn:
    """Runs the command and ends the process with its exit code, skipping interpreter
    finalization: the clients' native threads (Temporal's Rust core, gRPC's pollers) can call
    into Python while it finalizes and abort it ("PyGILState_Release ... finalizing", exit -6),
    seen once in CI after `trial status` had printed its answer. A short-lived command has
    nothing left to clean up once its output is flushed."""
    code = asyncio.run(_main(args))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
