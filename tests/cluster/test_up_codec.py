"""`switchyard up` (its own process, mTLS on, every port 0, the CPU executor only, the trial
worker on) seals what it stores in Temporal and serves the UI its codec endpoint: the key file
is made 0600 in a 0700 folder, the endpoint answers /decode with the same keys, on the UI's
host, CORS for the UI's origin only, and the worker, given the same keys, polls."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from google.protobuf import json_format
from temporalio.api.common.v1 import Payload, Payloads

from tests.cluster.up_helpers import start_up
from tests.conftest import ROOT
from workflows.temporal_codec import Keyring, encrypt

pytestmark = pytest.mark.slow
STARTUP_S = 300


def _wait_for(predicate: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while not predicate():
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.5)


def test_up_seals_payloads_and_serves_the_ui_its_codec_endpoint(tmp_path: Path) -> None:
    config = tmp_path / "switchyard.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[models]\nrepository = "{tmp_path / "models"}"\n'
        "[temporal]\nport = 0\nui_port = 0\n[metering]\nport = 0\n[evaluator]\nport = 0\n"
        "[router]\nport = 0\nopenai_port = -1\n"
        '[executors.cpu]\nport = 0\nmodels = ["mlp"]\n'
        "[executors.xla]\nenabled = false\n[executors.cuda]\nenabled = false\n"
        "[executors.tpu]\nenabled = false\n"
    )
    log = tmp_path / "up.log"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SWITCHYARD_SECURITY_", "SWITCHYARD_TEMPORAL"))
    }
    proc = start_up(config, tmp_path, log, {**env, "PYTHONPATH": str(ROOT)})
    state_file = tmp_path / "state" / "cluster.json"
    try:
        _wait_for(state_file.exists, proc, log)
        state = json.loads(state_file.read_text())
        keys = Path(state["temporal_env"]["SWITCHYARD_TEMPORAL_CODEC_KEY_FILE"])
        assert keys == (tmp_path / "state" / "keys" / "temporal-codec.key").resolve()
        assert (
            stat.S_IMODE(keys.stat().st_mode) == 0o600 and stat.S_IMODE(keys.parent.stat().st_mode) == 0o700
        )
        assert keys.read_text() not in state_file.read_text()  # cluster.json names the file only
        codec = state["services"]["temporal-codec"]["address"]
        ui = state["temporal_ui"]
        assert codec.rsplit(":", 1)[0] == ui.removeprefix("http://").rsplit(":", 1)[0]  # the UI's host
        assert state["services"]["trial-worker"]["state"] == "running"

        sealed = encrypt(Keyring.load(keys), [Payload(metadata={"encoding": b"json/plain"}, data=b'"grant"')])
        body = json_format.MessageToJson(Payloads(payloads=sealed)).encode()
        for origin, allowed in ((ui, True), ("http://elsewhere.test", False)):
            request = urllib.request.Request(
                f"http://{codec}/decode", body, {"Content-Type": "application/json", "Origin": origin}
            )
            with urllib.request.urlopen(request, timeout=10) as reply:
                (opened,) = json_format.Parse(reply.read(), Payloads()).payloads
                assert (reply.headers.get("Access-Control-Allow-Origin") == origin) is allowed
            assert opened.data == b'"grant"'
        assert "Temporal payloads encrypted" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
