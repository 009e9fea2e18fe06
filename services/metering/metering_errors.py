"""Metering's exception tree; `switchyard.grpcio` maps each to its gRPC status
(docs/architecture.md#errors)."""

from __future__ import annotations

from switchyard import errors


class MeteringError(errors.SwitchyardError):
    """Base of metering's expected errors."""


class BadInput(errors.InvalidArgument, MeteringError):
    """Malformed field, negative or reversed time range, malformed filter."""


class MoneyOverflow(BadInput):
    """An amount that would not fit in a signed 64-bit integer of micro-units."""


class UnknownEntity(errors.NotFound, MeteringError):
    """Unknown path, price key, reservation, job, principal, key or trial."""


class Conflict(errors.AlreadyExists, MeteringError):
    """An idempotency key or name reused with different content."""


class WrongState(errors.FailedPrecondition, MeteringError):
    """The entity is not in a state that allows this (closed reservation, revoked key...)."""


class AuthFailed(errors.Unauthenticated, MeteringError):
    """A key that is malformed, unknown, wrong, revoked or expired (one message for all)."""


class LedgerUnavailable(errors.Unavailable, MeteringError):
    """The ledger's database cannot be reached (a connection lost or refused, a server
    restarting): nothing was written, and the caller may send the same call again."""
