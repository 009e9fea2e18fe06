"""The evaluator's exception tree; `switchyard.grpcio` maps each class to its gRPC status."""

from __future__ import annotations

from switchyard.errors import InvalidArgument


class EvaluatorError(Exception):
    """Marker base for errors raised by the evaluator's domain code."""


class BadTensor(InvalidArgument, EvaluatorError):
    """A tensor whose bytes, shape or datatype do not agree (INVALID_ARGUMENT)."""


class BadCriteria(InvalidArgument, EvaluatorError):
    """Criteria or loss curves that cannot be judged as given (INVALID_ARGUMENT)."""
