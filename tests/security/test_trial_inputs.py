"""`inputs.file` outside its folder (issue 31, point 6): a spec named any path the worker could
read, and the error for a wrong sha256 gave the file's own, so a trial could fingerprint (or
confirm the contents of) any file on the worker. The worker's activities read inputs through
`payloads.make_inputs`; each attack goes through it as a trial's spec would.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import numpy as np
import pytest
from temporalio.exceptions import ApplicationError

from workflows.activities import payloads
from workflows.pipeline.types import InputsPlan


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    monkeypatch.setenv("SWITCHYARD_INPUTS_DIR", str(inputs))
    return inputs


def _npz(path: Path) -> str:
    buffer = io.BytesIO()
    np.savez(buffer, x=np.arange(8, dtype=np.float32).reshape(2, 4))
    path.write_bytes(buffer.getvalue())
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def _refused(name: str, sha: str = "0" * 64) -> ApplicationError:
    with pytest.raises(ApplicationError) as refused:
        payloads.make_inputs(InputsPlan(0, [], file=name, file_sha256=sha))
    assert refused.value.non_retryable
    return refused.value


def test_a_file_in_the_folder_is_read(folder: Path) -> None:
    sha = _npz(folder / "batch.npz")
    [(name, datatype, array)] = payloads.make_inputs(InputsPlan(0, [], file="batch.npz", file_sha256=sha))
    assert (name, datatype, array.shape) == ("x", "FP32", (2, 4))


def test_paths_out_of_the_folder_are_refused_before_reading(folder: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.npz"
    sha = _npz(secret)
    (folder / "link.npz").symlink_to(secret)
    for name in (str(secret), "../secret.npz", "link.npz", "sub/../../secret.npz", ".", "/etc/passwd"):
        error = _refused(name, sha)  # even with the right sha256: it is not the folder's file
        assert error.type == "InputsOutsideFolder", name
        assert "outside the worker's inputs folder" in error.message


def test_a_wrong_sha256_is_refused_without_the_files_own(folder: Path) -> None:
    actual = _npz(folder / "batch.npz")
    error = _refused("batch.npz", "1" * 64)
    assert error.type == "InputsChecksum"
    assert actual not in error.message and "1" * 64 in error.message


def test_a_missing_file_says_so_and_nothing_else(folder: Path) -> None:
    error = _refused("absent.npz")
    assert os.strerror(2) in error.message
