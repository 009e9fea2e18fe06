"""copy_fields: a message from the record it mirrors and a dataclass from a message, with the
fields that differ given by the caller; a field neither has is an error, never left empty."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from switchyard.field_copy import copy_fields, field_names
from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb


@dataclass(frozen=True)
class Timings:
    checkpoint_load_s: float
    to_device_s: float
    compile_s: float
    extra: str = "not in the message"

    @property
    def total_s(self) -> float:  # a property serves like a field
        return self.checkpoint_load_s + self.to_device_s + self.compile_s


@dataclass(frozen=True)
class Cost:
    path: str
    total_micros: int
    currency: str


def test_a_message_takes_each_of_its_fields_from_the_record() -> None:
    message = copy_fields(xpb.PhaseTimings, Timings(1.0, 2.0, 4.0))
    assert message == xpb.PhaseTimings(checkpoint_load_s=1.0, to_device_s=2.0, compile_s=4.0, total_s=7.0)


def test_a_dataclass_takes_its_fields_from_a_message_and_the_given_ones_from_the_caller() -> None:
    row = mpb.CostRow(group={"path": "cpu@h"}, total_micros=42, currency="EUR")
    assert copy_fields(Cost, row, path=row.group["path"]) == Cost("cpu@h", 42, "EUR")
    assert field_names(Cost) == ["path", "total_micros", "currency"]


def test_a_field_the_source_lacks_is_an_error_not_an_empty_value() -> None:
    with pytest.raises(AttributeError, match="path"):
        copy_fields(Cost, mpb.CostRow(total_micros=1))


def test_a_given_field_the_target_does_not_have_is_an_error() -> None:
    with pytest.raises(TypeError, match="PhaseTimings has no field totl_s"):
        copy_fields(xpb.PhaseTimings, Timings(1.0, 2.0, 4.0), totl_s=3.0)
    # named even where the source lacks the field the misspelt name stands for
    with pytest.raises(TypeError, match="PathInfo has no field prced"):
        copy_fields(mpb.PathInfo, object(), prced=True)
