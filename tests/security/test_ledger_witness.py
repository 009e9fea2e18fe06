"""The witness that metering cannot forge: a separate process with its own key and store.

The insider holds the database, the anchor's folder and the audit key, but not the
witness's private key. They cut the tail while metering is stopped and put back an older,
genuinely signed anchor (nothing local remembers the newer one): the witness's newest
countersigned head still names the rows that are gone. A head below one it signed, or with
another digest at a signed seq, is refused; a head from an impostor witness (another key)
is not believed.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.metering.witness_client import WitnessClient, WitnessRefused, WitnessUnreachable
from services.witness.witness import Cosigned, check_signature
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from tests.security.ledger_attack import (
    ROOT,
    Metering,
    anchored,
    append,
    assert_writes_refused,
    read,
    truncate_tail,
)


class WitnessProcess:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.witness", "--dir", str(folder), "--port", "0"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "witness serving on HOST:PORT key HEX"
        assert line.startswith("witness serving on "), line
        words = line.split()
        self.url, self.public_hex = f"http://{words[3]}", words[5]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def witness(tmp_path: Path) -> Iterator[WitnessProcess]:
    proc = WitnessProcess(tmp_path / "witness")
    try:
        yield proc
    finally:
        proc.stop()


def test_the_witness_refuses_rollback_and_split_views(witness: WitnessProcess, tmp_path: Path) -> None:
    client = WitnessClient(witness.url, witness.public_hex, "ledger-a")
    first = client.submit(5, "a" * 64)
    assert check_signature(witness.public_hex, first)
    assert client.submit(5, "a" * 64) == first  # the same head again: the same countersignature
    with pytest.raises(WitnessRefused, match="below seq 5"):
        client.submit(4, "b" * 64)
    with pytest.raises(WitnessRefused, match="split view"):
        client.submit(5, "c" * 64)
    client.submit(7, "d" * 64)
    assert client.latest() == Cosigned("ledger-a", 7, "d" * 64, client.latest().signature)  # type: ignore[union-attr]
    forged = Cosigned("ledger-a", 9, "e" * 64, first.signature)
    assert not check_signature(witness.public_hex, forged)
    # Its heads outlive the process: restarted, it still refuses the lower head.
    witness.stop()
    again = WitnessProcess(witness.folder)
    try:
        assert again.public_hex == witness.public_hex
        with pytest.raises(WitnessRefused):
            WitnessClient(again.url, again.public_hex, "ledger-a").submit(6, "f" * 64)
    finally:
        again.stop()
        witness.proc = again.proc
    for name in ("witness.key", "heads.jsonl"):
        assert stat.S_IMODE((witness.folder / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE(witness.folder.stat().st_mode) == 0o700


def test_a_malformed_head_gets_400(witness: WitnessProcess) -> None:
    req = urllib.request.Request(f"{witness.url}/v1/cosign", json.dumps({"log": "x"}).encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 400


@pytest.fixture
def witnessed(witness: WitnessProcess, monkeypatch: pytest.MonkeyPatch, anchor: Path) -> WitnessProcess:
    monkeypatch.setenv("SWITCHYARD_AUDIT_WITNESS", witness.url)
    monkeypatch.setenv("SWITCHYARD_AUDIT_WITNESS_KEY", str(witness.folder / "witness.pub"))
    return witness


async def witnessed_seq(witness: WitnessProcess, seq: int, timeout_s: float = 5.0) -> None:
    client = WitnessClient(witness.url, witness.public_hex)
    deadline = time.monotonic() + timeout_s
    while (head := await asyncio.to_thread(client.latest)) is None or head.seq < seq:
        assert time.monotonic() < deadline, "metering never had its head countersigned"
        await asyncio.sleep(0.05)


async def test_a_rollback_while_stopped_is_caught_by_the_witness(
    metering: Metering, anchor: Path, db_url: str, witnessed: WitnessProcess
) -> None:
    stub = await metering.start()
    await append(stub, 4)
    assert metering.running is not None
    keep = await anchored(anchor, metering.running)
    older = read(anchor)
    await append(stub, 4)
    await witnessed_seq(witnessed, await anchored(anchor, metering.running))
    await metering.stop()
    truncate_tail(db_url, keep)
    await asyncio.to_thread(anchor.write_bytes, older)  # genuinely signed, fits the cut chain
    for _ in range(2):
        stub = await metering.start()
        verdict = await stub.VerifyAudit(mpb.VerifyAuditRequest())
        assert not verdict.ok and verdict.problem in ("witness", "anchor"), verdict
        assert metering.running is not None
        assert "witness" in metering.running.ledger.audit.verify().message
        await assert_writes_refused(stub)
        await metering.stop()


async def test_an_impostor_witness_is_not_believed(
    metering: Metering,
    anchor: Path,
    witnessed: WitnessProcess,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stub = await metering.start()
    await append(stub, 3)
    assert metering.running is not None
    await witnessed_seq(witnessed, await anchored(anchor, metering.running))
    assert (await stub.VerifyAudit(mpb.VerifyAuditRequest())).ok
    await metering.stop()
    impostor = WitnessProcess(tmp_path / "impostor")  # the insider's own witness, own key
    try:
        monkeypatch.setenv("SWITCHYARD_AUDIT_WITNESS", impostor.url)
        stub = await metering.start()
        verdict = await stub.VerifyAudit(mpb.VerifyAuditRequest())
        assert (verdict.ok, verdict.problem) == (False, "witness"), verdict
        assert metering.running is not None
        assert "not signed with its key" in metering.running.ledger.audit.verify().message
    finally:
        await metering.stop()
        impostor.stop()
    with pytest.raises(WitnessUnreachable):
        WitnessClient(impostor.url, witnessed.public_hex).latest()
