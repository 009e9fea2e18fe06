"""`switchyard up` (the package's: its own process, mTLS on, every port 0, the CPU executor
only, the trial worker on; tests/cluster/conftest.py) seals what it stores in Temporal and
serves the UI its codec endpoint: the key file is made 0600 in a 0700 folder, the endpoint
answers /decode with the same keys, on the UI's host, CORS for the UI's origin only, and the
worker, given the same keys, polls."""

from __future__ import annotations

import asyncio
import base64
import stat
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.client import Client

from clients.local_cluster import demo_trial as trials
from clients.local_cluster.demo import Endpoints
from clients.local_cluster.traffic import create_team_key
from switchyard import tls
from tests.cluster.up_helpers import UpCluster
from workflows.activities.authorization import GRANT_MEMO
from workflows.temporal_codec import Keyring, encrypt
from workflows.worker import connect

pytestmark = pytest.mark.slow


def _trial_through_the_demo_path(state: dict[str, Any], tmp_path: Path) -> None:
    """A trial started as `switchyard demo` starts it (its grant from metering in the memo,
    over Endpoints.link()) completes, and a plain client finds neither grant nor spec."""
    tls.set_default(tls.Security.from_dir(state["tls_dir"]))
    try:
        ep = Endpoints.from_state(state)
        team = asyncio.run(create_team_key(ep.metering, "team-sealed", trials=("tiny-lm",)))
        spec = trials.demo_spec(team.team)
        spec["paths"] = [
            {"name": "ref", "executor": "cpu", "mode": "eager"},
            {"name": "cand", "executor": "cpu", "mode": "eager"},
        ]
        spec["reference"] = "ref"
        spec["performance"] = {"warmup": 1, "min_iterations": 5, "min_seconds": 0.2, "batch_sizes": [1]}
        trial_id = f"sealed-{uuid.uuid4().hex[:6]}"
        outcome = asyncio.run(
            trials.run_trial(
                ep.link(), ep.task_queue, tmp_path / "reports", trial_id, spec, lambda _: None,
                metering=ep.metering, api_key=team.key,
            )
        )  # fmt: skip
        assert outcome.status == "completed" and set(outcome.verdicts) == {"cand"}

        async def raw_and_opened() -> tuple[str, bytes, str]:
            plain = await Client.connect(ep.temporal)  # no codec: what Temporal holds
            raw = plain.get_workflow_handle(trial_id)
            memo = (await raw.describe()).raw_description.workflow_execution_info.memo
            opened = await connect(ep.link())  # the demo's and CLI's way: the codec
            grant = (await (await opened.get_workflow_handle(trial_id).describe()).memo())[GRANT_MEMO]
            return (await raw.fetch_history()).to_json(), memo.SerializeToString(), str(grant)

        history, memo, grant = asyncio.run(raw_and_opened())
        assert len(grant) > 40 and grant not in history and grant.encode() not in memo
        at = history.find(team.team)
        assert at < 0, history[max(0, at - 1500) : at + 200]  # the spec's team
        assert base64.b64encode(b"binary/encrypted").decode() in history  # proto JSON: bytes in base64
    finally:
        tls.set_default(None)


def test_up_seals_payloads_and_serves_the_ui_its_codec_endpoint(
    up_cluster: UpCluster, tmp_path: Path
) -> None:
    state = up_cluster.state
    keys = Path(state["temporal_env"]["SWITCHYARD_TEMPORAL_CODEC_KEY_FILE"])
    assert keys == (up_cluster.root / "state" / "keys" / "temporal-codec.key").resolve()
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600 and stat.S_IMODE(keys.parent.stat().st_mode) == 0o700
    assert (
        keys.read_text() not in (up_cluster.root / "state" / "cluster.json").read_text()
    )  # names the file only
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
    assert "Temporal payloads encrypted" in up_cluster.log.read_text()
    _trial_through_the_demo_path(state, tmp_path)
