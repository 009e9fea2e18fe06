"""`switchyard backends`: which accelerator paths this environment can run, and why not.

Describe-style detection without starting an executor: for each backend, a DescribeResponse
(device with `available` / `unavailable_reason`, torch and backend versions, modes, resource
class) as JSON. A backend that cannot run here (torch_xla missing in the main env; torch_tpu,
libtpu or a TPU chip missing for tpu) is reported with the reason and nothing is initialised
for it, so this is safe on any host. Exit status 0 if every requested backend is available,
else 1.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from switchyard.field_copy import copy_fields

if TYPE_CHECKING:
    from services.executor.backends.base import DeviceDescription
    from switchyard.gen.switchyard.v1 import executor_pb2


def device_info(device: DeviceDescription) -> executor_pb2.DeviceInfo:
    """A backend's device description as Describe and `switchyard backends` report it."""
    from switchyard.gen.switchyard.v1 import executor_pb2 as pb

    return copy_fields(pb.DeviceInfo, device)


def describe_backend(name: str) -> Any:
    """A DescribeResponse for one backend, as far as this environment can tell."""
    from services.executor.backends.base import base_versions
    from services.executor.device import BackendUnavailable, load_backend_class
    from switchyard.gen.switchyard.v1 import executor_pb2 as pb

    try:
        backend = load_backend_class(name)()
    except BackendUnavailable as exc:
        return pb.DescribeResponse(
            device=pb.DeviceInfo(backend=name, available=False, unavailable_reason=str(exc))
        )
    availability = backend.availability()
    reply = pb.DescribeResponse(modes=list(backend.modes))
    if not availability.available:
        reply.device.CopyFrom(
            pb.DeviceInfo(backend=name, available=False, unavailable_reason=availability.reason)
        )
        reply.versions.update(base_versions())
        reply.torch_version = reply.versions.get("torch", "")
        return reply
    reply.device.CopyFrom(device_info(backend.describe_device()))
    reply.versions.update(backend.versions())
    reply.torch_version = reply.versions.get("torch", "")
    reply.resource_class = backend.resource_class()
    return reply


def _run(args: argparse.Namespace) -> int:
    import json

    from google.protobuf.json_format import MessageToDict

    from services.executor.device import BACKENDS

    names = [n for n in args.backend.split(",") if n] if args.backend else list(BACKENDS)
    replies = {name: describe_backend(name) for name in names}
    out = {
        name: MessageToDict(
            reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        for name, reply in replies.items()
    }
    print(json.dumps(out, indent=2, sort_keys=True))
    return 0 if all(r.device.available for r in replies.values()) else 1


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser("backends", help="which accelerator paths this environment can run, and why not")
    parser.add_argument("--backend", default="", help="comma-separated backends (default: all)")
    parser.set_defaults(func=_run)


if __name__ == "__main__":
    sys.exit(_run(argparse.Namespace(backend="")))
