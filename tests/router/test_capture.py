"""Workload capture at the router: opt-in, inputs only, bounded (drop, never wait), audited,
closed into immutable files with their sha256 in a manifest, read back by `switchyard workloads`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton

from clients.cli import main as switchyard
from services.executor.executor_server import RunningExecutor
from switchyard.errors import InvalidArgument
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.judge.capture_format import find_workload, list_workloads, read_records
from tests.router.conftest import Metering, RouterFactory, routes_config


def _send(address: str, key: str, arrays: list[np.ndarray]) -> None:
    client = triton.InferenceServerClient(address)
    try:
        for i, x in enumerate(arrays):
            tensor = triton.InferInput("x", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            client.infer(
                "mlp", [tensor], request_id=f"secret-request-{i}",
                headers={"authorization": f"Bearer {key}"}, parameters={"team_note": "secret-param"},
            )  # fmt: skip
    finally:
        client.close()


async def test_capture_keeps_inputs_only_in_order_bounded_and_audited(
    metering: Metering,
    executors: list[RunningExecutor],
    make_router: RouterFactory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    workloads = tmp_path / "workloads"
    cfg = routes_config(
        {"a": executors[0].address},
        {
            "mlp": {
                "policy": "pinned",
                "targets": ["a"],
                "capture": {"share": 1.0, "max_mb": 4, "retention": 3600},
            }
        },
        workloads_dir=str(workloads),
    )
    router = await make_router(cfg, metering.running.address)
    key, _ = await metering.key("svc-capture", "ads", "infer", "*")
    rng = np.random.default_rng(3)
    sent = [rng.standard_normal((rows, 64)).astype(np.float32) for rows in (1, 3, 2, 4, 1, 1)]
    await asyncio.to_thread(_send, router.address, key, sent)
    capture = router.router.captures["mlp"]
    assert capture.stats.sampled == len(sent) and capture.stats.dropped == 0
    await capture.close()  # as a router stop does: the open segment becomes a workload

    (entry,) = list_workloads(workloads)
    assert entry["requests"] == len(sent) and entry["route"] == "mlp"
    path, _ = find_workload(workloads, entry["id"])
    assert (path.stat().st_mode & 0o777) == 0o600 and (workloads / "mlp").stat().st_mode & 0o077 == 0
    captured = read_records(path, entry["sha256"], pb.ModelInferRequest.FromString)
    for request, x in zip(captured, sent, strict=True):  # in order, with their real shapes
        assert list(request.inputs[0].shape) == list(x.shape)
        np.testing.assert_array_equal(
            np.frombuffer(request.raw_input_contents[0], np.float32).reshape(x.shape), x
        )
        assert not request.id and not request.parameters  # no request id, no caller parameters
    blob = path.read_bytes()
    assert b"secret" not in blob and key.encode() not in blob

    assert switchyard(["workloads", "show", entry["id"], "--dir", str(workloads)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["requests"] == 6 and shown["shapes"]["x"] == {"1x64": 3, "3x64": 1, "2x64": 1, "4x64": 1}
    assert shown["bytes"]["total"] == sum(x.nbytes for x in sent)
    out = tmp_path / "export.rec"
    assert switchyard(["workloads", "export", entry["id"], "-o", str(out), "--dir", str(workloads)]) == 0
    assert out.read_bytes() == blob
    # a file changed after capture is refused with both hashes
    path.write_bytes(blob + b"\x00")
    with pytest.raises(Exception, match=entry["sha256"]):
        read_records(path, entry["sha256"], pb.ModelInferRequest.FromString)

    audit = await metering.stub.QueryAudit(mpb.QueryAuditRequest(action="workload.capture", limit=10))
    assert any(json.loads(r.detail_json)["share"] == 1.0 for r in audit.records)


async def test_capture_drops_rather_than_waits_when_the_writer_is_behind(
    executors: list[RunningExecutor], make_router: RouterFactory, tmp_path: Path
) -> None:
    cfg = routes_config(
        {"a": executors[0].address},
        {"mlp": {"policy": "pinned", "targets": ["a"], "capture": {"share": 1.0, "max_pending": 1}}},
        workloads_dir=str(tmp_path / "w"), require_auth=False,
    )  # fmt: skip
    router = await make_router(cfg)
    capture = router.router.captures["mlp"]
    capture.paused = True  # the writer is behind: it takes nothing from the queue
    x = np.zeros((1, 64), np.float32)
    await asyncio.gather(*(asyncio.to_thread(_send, router.address, "", [x]) for _ in range(4)))
    assert capture.stats.sampled == 4 and capture.stats.dropped == 3  # served all, kept one
    capture.paused = False


@pytest.mark.parametrize(
    ("capture", "text"),
    [
        ({"share": 0}, "capture.share"),
        ({"share": 0.5, "max_mb": 0}, "capture.max_mb"),
        ({"share": 0.5, "retention": -1}, "capture.retention"),
        ({"share": 0.5, "who": "x"}, "unknown keys"),
    ],
)
def test_bad_capture_settings_are_named(capture: dict[str, Any], text: str) -> None:
    with pytest.raises(InvalidArgument, match=text):
        routes_config(
            {"a": "127.0.0.1:1"}, {"mlp": {"policy": "pinned", "targets": ["a"], "capture": capture}}
        )
