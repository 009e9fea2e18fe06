"""`switchyard up` with a user's model repository: a model built with transformers and
`switchyard models add`-ed (team-bert, before the package's `up` started: tests/cluster/conftest.py)
is served by the cluster's executor and trialled from the Temporal CLI (`temporal workflow
execute`), as an operator would without any switchyard client (the trial runs as the worker's
Temporal-UI principal, under mTLS); and the cluster's audit witness countersigns the ledger's
head."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.up_helpers import UpCluster

pytestmark = pytest.mark.slow
ANCHOR_S = 10  # metering's anchor round (SWITCHYARD_AUDIT_ANCHOR_S default)


def _witnessed_head(address: str, within_s: float) -> dict[str, Any]:
    """The newest head the witness countersigned, once it has one (its first anchor round
    with rows in the chain), at most `within_s` from now."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with urllib.request.urlopen(
                f"http://{address}/v1/latest?log=switchyard-ledger", timeout=5
            ) as reply:
                return dict(json.loads(reply.read()))
        except urllib.error.HTTPError as err:
            assert err.code == 404 and time.monotonic() < deadline, err
            time.sleep(0.5)


def test_a_user_model_is_served_by_up_and_trialled_from_the_temporal_cli(
    up_cluster: UpCluster, tmp_path: Path
) -> None:
    state = up_cluster.state
    assert "team-bert" in state["services"]["executor-cpu"]["models"]
    spec = {
        "model": {"name": "team-bert"},
        "inputs": {
            "seed": 3,
            "tensors": [
                {"name": "input_ids", "datatype": "INT64", "shape": [2, 8], "low": 1, "high": 100},
                {"name": "attention_mask", "datatype": "INT64", "shape": [2, 8], "low": 1, "high": 2},
            ],
        },
        "paths": [
            {"name": "cpu", "executor": "cpu", "mode": "eager"},
            {"name": "cpu-bf16", "executor": "cpu", "mode": "eager", "precision": "bf16"},
        ],
        "reference": "cpu",
        "criteria": {"logits": True},
        "performance": {"warmup": 2, "min_iterations": 10, "min_seconds": 0.3, "batch_sizes": [1]},
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    temporal = Path(sys.executable).with_name("temporal")
    # what Temporal stores is sealed (workflows/temporal_codec.py): the CLI reads the report
    # through the codec endpoint `up` serves, as the UI does
    codec = f"http://{state['services']['temporal-codec']['address']}"
    result = subprocess.run(
        [str(temporal), "workflow", "execute", "--address", state["temporal_address"],
         "--codec-endpoint", codec,
         "--task-queue", "switchyard-trials", "--type", "TrialWorkflow", "--workflow-id", "team-bert",
         "--input-file", str(tmp_path / "spec.json"), "-o", "json"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)["result"]
    assert report["status"] == "completed"
    assert report["verdicts"]["cpu-bf16"]["verdict"] in ("ADOPT", "REJECT", "INCONCLUSIVE")
    # up's example price book: the cost criterion is judged, not left unpriced
    for path in ("cpu", "cpu-bf16"):
        economics = report["paths"][path]["economics"]
        assert not economics["unpriced"] and economics["total_micros"] > 0, economics
    cost = report["verdicts"]["cpu-bf16"]["criteria"]["cost"]
    assert cost["figure"] != "unpriced" and "EXAMPLE price book" in cost["reason"], cost
    assert report["paths"]["cpu"]["economics"]["example_priced_lines"] > 0  # marked as such
    assert "EXAMPLE price book in force (USD cpu 0.12/h)" in up_cluster.log.read_text()
    # the audit witness, its own process: it holds the ledger's head, which metering signed
    # at start and anchors since; its private key stays in its own 0700 folder
    head = _witnessed_head(state["services"]["witness"]["address"], within_s=ANCHOR_S + 10)
    assert head["seq"] > 0 and head["signature"], head
    folder = up_cluster.root / "state" / "witness"
    assert (folder.stat().st_mode & 0o777, (folder / "witness.key").stat().st_mode & 0o777) == (
        0o700,
        0o600,
    )
    sha = report["paths"]["cpu"]["prepare"]["checkpoint_sha256"]
    assert sha and sha == report["paths"]["cpu-bf16"]["prepare"]["checkpoint_sha256"]
