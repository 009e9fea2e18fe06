"""A factory module that must never be imported by an executor that does not allow it."""

from __future__ import annotations

from tests.executor.user_model import Scaler

IMPORTED = True


def build() -> Scaler:
    return Scaler()
