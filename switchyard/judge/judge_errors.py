"""The judge's exception tree; `switchyard.grpcio` maps each class to its gRPC status, so the
evaluator service answers INVALID_ARGUMENT and the router and worker see the same classes."""

from __future__ import annotations

from switchyard.errors import InvalidArgument


class JudgeError(Exception):
    """Marker base for errors raised by the judge library."""


class BadTensor(InvalidArgument, JudgeError):
    """A tensor whose bytes, shape or datatype do not agree (INVALID_ARGUMENT)."""


class BadCriteria(InvalidArgument, JudgeError):
    """Criteria or loss curves that cannot be judged as given (INVALID_ARGUMENT)."""
