"""TLS to Temporal where the cluster offers it (issue 31, point 4). The dev server has no TLS,
so a TLS-terminating relay stands in front of it, as a load balancer or a Temporal frontend with
`tls.frontend` would: its certificate comes from switchyard.tls's local PKI, and it asks for a
client certificate (mTLS). Over the relay, through `workflows.worker.connect` as the worker
and the CLI dial, a worker polls and a trial runs to its report. A plaintext client to the TLS
port gets nowhere, nor does a TLS client that does not trust the relay's CA."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from switchyard import tls
from tests.security.test_grant_replay import _spec
from tests.trial.conftest import codec_key_file, temporal_env
from workflows.activities.connections import Connections, WorkerConfig
from workflows.spec.trial_io import TrialInput
from workflows.temporal_link import TemporalLink, TemporalTLS
from workflows.trial import TrialWorkflow
from workflows.worker import build_worker, connect

__all__ = ["temporal_env"]
NAME = "temporal.switchyard.internal"  # what the relay's certificate carries


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


@contextlib.asynccontextmanager
async def tls_relay(target: str, folder: Path) -> AsyncIterator[str]:
    """A TLS (client certificate required) listener on 127.0.0.1:0 that forwards to `target`."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(folder / tls.CERT_FILE, folder / tls.KEY_FILE)
    ctx.load_verify_locations(folder / tls.CA_FILE)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["h2"])
    host, port = target.rsplit(":", 1)
    tasks: set[asyncio.Future[tuple[None, None]]] = set()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
        both = asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        tasks.add(both)

    server = await asyncio.start_server(relay, "127.0.0.1", 0, ssl=ctx)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        # retrieve every pipe's end here: a future dropped unretrieved logs a traceback from its
        # finaliser, and on 3.11 that traceback's ast.parse, run inside another ast.parse by
        # the garbage collector, breaks the latter ("AST constructor recursion depth mismatch")
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_worker_and_a_trial_run_over_tls_and_plaintext_is_refused(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    pki = tls.ensure_local_pki(tmp_path / "tls", ["temporal", "worker", "operator"])
    target = str(temporal_env.client.service_client.config.target_host)
    async with tls_relay(target, pki["temporal"]) as address:

        def link(who: str) -> TemporalLink:
            folder = pki[who]
            security = TemporalTLS.of(
                str(folder / tls.CA_FILE), str(folder / tls.CERT_FILE), str(folder / tls.KEY_FILE), NAME
            )
            return TemporalLink(address, "default", security, codec_key_file(temporal_env))

        # plaintext to the TLS port, or TLS without the relay's CA: no connection
        with pytest.raises(RuntimeError):
            await asyncio.wait_for(Client.connect(address), 20)
        stranger = tls.ensure_local_pki(tmp_path / "other-ca", ["worker"])["worker"]
        untrusted = TemporalTLS.of(str(stranger / tls.CA_FILE), server_name=NAME)
        with pytest.raises(RuntimeError):
            await asyncio.wait_for(connect(TemporalLink(address, tls=untrusted)), 20)

        worker_client, operator = await connect(link("worker")), await connect(link("operator"))
        assert worker_client.service_client.config.tls
        queue = f"q-{uuid.uuid4().hex[:8]}"
        connections = Connections(WorkerConfig(metering="127.0.0.1:1"))  # insecure test worker
        try:
            async with build_worker(worker_client, connections, task_queue=queue):
                report = await operator.execute_workflow(
                    TrialWorkflow.run,
                    TrialInput.from_json(_spec()),
                    id=f"t-tls-{uuid.uuid4().hex[:6]}",
                    task_queue=queue,
                )
        finally:
            await connections.close()
    assert report.status == "completed"
    assert set(report.to_json()["verdicts"]) == {"b"}  # the candidate judged (INCONCLUSIVE: no executor)
