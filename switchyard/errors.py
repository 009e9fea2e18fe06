"""The root of every service's exception tree, with the status each error maps to.

Domain code raises these and never imports grpc; `switchyard.grpcio` maps them to gRPC
status codes in one place. Messages say what to fix and never carry secrets.
"""

from __future__ import annotations

import enum


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
    # Seen only as another service's answer, passed on (`UpstreamError`); never raised here.
    UNKNOWN = "UNKNOWN"
    ABORTED = "ABORTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    DATA_LOSS = "DATA_LOSS"


class SwitchyardError(Exception):
    """Base of all expected errors; `status` says which gRPC status the edge returns (a class
    attribute of each subclass; an `UpstreamError` carries the status it was answered with)."""

    status: Status = Status.INTERNAL


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


class RateLimited(ResourceExhausted):
    """Over a rate or a count a caller may use; `retry_after_ms` goes to the caller as the
    trailing metadata `retry-after-ms` (`trailers`, which switchyard.grpcio sets)."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = max(1, retry_after_ms)

    @property
    def trailers(self) -> tuple[tuple[str, str], ...]:
        return (("retry-after-ms", str(self.retry_after_ms)),)


class DeadlineExceeded(SwitchyardError):
    status = Status.DEADLINE_EXCEEDED


class Unavailable(SwitchyardError):
    status = Status.UNAVAILABLE


class Unimplemented(SwitchyardError):
    status = Status.UNIMPLEMENTED


class Cancelled(SwitchyardError):
    status = Status.CANCELLED


class UpstreamError(SwitchyardError):
    """Another service's own status and message (an executor's answer to the router), passed
    through to the caller unchanged: the edge answers with `status`, as for any other error."""

    def __init__(self, status: Status, details: str) -> None:
        super().__init__(details)
        self.status = status
        self.details = details
