"""The root of every service's exception tree, with the status each error maps to.

Domain code raises these and never imports grpc; `switchyard.grpcio` maps them to gRPC
status codes in one place. Messages say what to fix and never carry secrets.
"""

from __future__ import annotations

import enum
from typing import ClassVar


class Status(enum.Enum):
    """Status names as in docs/architecture.md#errors (the gRPC code of the same name)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNAVAILABLE = "UNAVAILABLE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"


class SwitchyardError(Exception):
    """Base of all expected errors; `status` says which gRPC status the edge returns."""

    status: ClassVar[Status] = Status.INTERNAL


class InvalidArgument(SwitchyardError):
    status = Status.INVALID_ARGUMENT


class NotFound(SwitchyardError):
    status = Status.NOT_FOUND


class AlreadyExists(SwitchyardError):
    status = Status.ALREADY_EXISTS


class FailedPrecondition(SwitchyardError):
    status = Status.FAILED_PRECONDITION


class Unauthenticated(SwitchyardError):
    status = Status.UNAUTHENTICATED


class PermissionDenied(SwitchyardError):
    status = Status.PERMISSION_DENIED


class ResourceExhausted(SwitchyardError):
    status = Status.RESOURCE_EXHAUSTED


class DeadlineExceeded(SwitchyardError):
    status = Status.DEADLINE_EXCEEDED


class Unavailable(SwitchyardError):
    status = Status.UNAVAILABLE


class Unimplemented(SwitchyardError):
    status = Status.UNIMPLEMENTED


class Cancelled(SwitchyardError):
    status = Status.CANCELLED
