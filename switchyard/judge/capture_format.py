"""The captured workload's file format: what the router's capturer writes and a trial replays.

A route's folder holds segment files and a `manifest.json`. A segment is a run of records,
each a little-endian uint32 length and one serialized ModelInferRequest reduced to model,
version and input tensors (a generation adds the output length the router saw, `SEEN`).
It is written as `<id>.rec.partial` and renamed to `<id>.rec` when it closes; the manifest
then lists it (`id` = `<route>.<time-ordered id>`, `file`, `sha256`, `requests`, `bytes`,
`started_unix_s`, `closed_unix_s`), and a listed segment is one immutable workload.

Pure: records come back as bytes, and the caller decodes them with its own message class
(`read_records(path, sha256, pb.ModelInferRequest.FromString)`), so this module needs no
protobuf. The writer, with its sampling and queue, is the router's (services/router/capture.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from switchyard.errors import FailedPrecondition, NotFound

MANIFEST = "manifest.json"
RECORD_SUFFIX = ".rec"
PARTIAL_SUFFIX = ".rec.partial"
SEEN = "output_tokens_seen"  # a captured generation's output length, as the router saw it
RECORD = struct.Struct("<I")  # each record's length

T = TypeVar("T")


def frame(record: bytes) -> bytes:
    """One record as it sits in a segment: its length, then its bytes."""
    return RECORD.pack(len(record)) + record


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.exists():
        return {"route": folder.name, "workloads": []}
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Replaces the manifest atomically (a reader sees the old one or the new one), mode 0600."""
    tmp = folder / f".{MANIFEST}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
    tmp.replace(folder / MANIFEST)


def list_workloads(root: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not root.is_dir():
        return out
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        for entry in read_manifest(folder)["workloads"]:
            out.append({"route": folder.name, **entry})
    return out


def workload_route(workload: str) -> str:
    """The route a workload was captured at: its id is `<route>.<number>`."""
    return workload.rsplit(".", 1)[0]


def find_workload(root: Path, workload: str) -> tuple[Path, dict[str, Any]]:
    route = workload_route(workload)
    if route and route not in (".", "..") and "/" not in workload and (root / route).is_dir():
        for entry in read_manifest(root / route)["workloads"]:
            if entry["id"] == workload:
                return root / route / entry["file"], entry
    known = [w["id"] for w in list_workloads(root)]
    raise NotFound(f"unknown workload {workload!r} in {root}; known: {known[-5:] or 'none'}")


def read_records(path: Path, expected_sha256: str, decode: Callable[[bytes], T]) -> list[T]:
    """The captured records in order, each through `decode`; the file must hash to
    `expected_sha256` when given."""
    blob = path.read_bytes()
    actual = hashlib.sha256(blob).hexdigest()
    if expected_sha256 and actual != expected_sha256:
        raise FailedPrecondition(
            f"workload {path.name} hashes to {actual}, but {expected_sha256} was expected"
        )
    out, at = [], 0
    while at < len(blob):
        (size,) = RECORD.unpack_from(blob, at)
        at += RECORD.size
        out.append(decode(blob[at : at + size]))
        at += size
    return out


class _Tensor(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> Sequence[int]: ...


class CapturedRequest(Protocol):
    """What `distribution` reads of a decoded record (a ModelInferRequest has it)."""

    @property
    def inputs(self) -> Sequence[_Tensor]: ...
    @property
    def raw_input_contents(self) -> Sequence[bytes]: ...


def distribution(requests: Iterable[CapturedRequest]) -> dict[str, Any]:
    """Request count, and per input the shapes seen (with counts) and the byte sizes."""
    shapes: dict[str, dict[str, int]] = {}
    sizes: list[int] = []
    for r in requests:
        sizes.append(sum(len(c) for c in r.raw_input_contents))
        for t in r.inputs:
            key = "x".join(str(d) for d in t.shape)
            shapes.setdefault(t.name, {})[key] = shapes.setdefault(t.name, {}).get(key, 0) + 1
    ordered = sorted(sizes)
    return {
        "requests": len(sizes),
        "shapes": shapes,
        "bytes": {
            "total": sum(sizes),
            "min": ordered[0] if ordered else 0,
            "p50": ordered[len(ordered) // 2] if ordered else 0,
            "max": ordered[-1] if ordered else 0,
        },
    }
