"""The operator CLI against the real stack: start --wait with progress, status, report, bad spec."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path

from tests.trial.stack import ROOT, Stack
from tests.trial.trial_helpers import connections, tiny_spec
from workflows.worker import build_worker


async def _cli(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "clients.cli",
        *args,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 240)
    return int(process.returncode or 0), out.decode(), err.decode()


async def test_invalid_spec_is_refused_before_anything_starts(tmp_path: Path) -> None:
    spec = tiny_spec(
        [{"name": "a", "executor": "cpu", "mode": "eager"}, {"name": "b", "executor": "cpu", "mode": "jit"}]
    )
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(spec))
    # no Temporal at this address: the spec is checked before connecting
    code, _, err = await _cli("trial", "start", str(path), "--temporal", "127.0.0.1:1")
    assert code == 2
    assert "paths[1].mode: 'jit' is not one of eager" in err


async def test_start_wait_status_and_report(stack: Stack, tmp_path: Path) -> None:
    spec = tiny_spec(
        [
            {"name": "cpu-eager", "executor": "cpu", "mode": "eager"},
            {"name": "perturbed", "executor": "cpu", "mode": "eager", "version": "perturbed"},
        ]
    )
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    queue = f"cli-{uuid.uuid4().hex[:8]}"
    trial_id = f"cli-{uuid.uuid4().hex[:8]}"
    conns = connections(stack)
    try:
        async with build_worker(stack.env.client, conns, task_queue=queue):
            common = ("--temporal", stack.temporal, "--codec-key-file", stack.codec_key_file)
            code, out, err = await _cli(
                "trial", "start", str(path), "--wait", "--id", trial_id, "--task-queue", queue, *common
            )
            assert code == 0, f"exit {code}: {err[-1500:]}"
            assert f"started {trial_id}" in out
            assert "perturbed: REJECT" in out and "correctness: fail" in out
            assert "%" in err and "cpu-eager:" in err  # the progress lines
            code, out, err = await _cli("trial", "status", trial_id, *common)
            assert code == 0, f"exit {code}: {err[-1500:]}"
            assert "perturbed: REJECT" in out
    finally:
        await conns.close()
    html = tmp_path / "report.html"
    code, out, err = await _cli("trial", "report", trial_id, "-o", str(html), "--metering", stack.metering)
    assert code == 0, f"exit {code}: {err[-1500:]}"
    page = html.read_text()
    assert page.startswith("<!DOCTYPE html>") and "REJECT" in page and "<svg" in page
    code, out, err = await _cli("trial", "report", trial_id, "--format", "md", "--metering", stack.metering)
    assert code == 0, f"exit {code}: {err[-1500:]}"
    assert out.startswith(f"# Trial {trial_id}: tiny-lm")
