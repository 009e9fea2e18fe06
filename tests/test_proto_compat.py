"""Our OIP protos must be wire-compatible with Triton's, and coexist with tritonclient.

tritonclient registers its own `inference.*` messages in protobuf's default pool; ours live
in a private pool, so both import into one process. The field-by-field comparison below is
against the descriptors tritonclient ships, i.e. Triton's own grpc_service.proto.
"""

from __future__ import annotations

from typing import Any

import tritonclient.grpc  # noqa: F401  (imported first on purpose: the collision trap)
from tritonclient.grpc import model_config_pb2 as triton_config
from tritonclient.grpc import service_pb2 as triton_service

from switchyard.gen.inference import grpc_service_pb2, grpc_service_pb2_grpc, model_config_pb2


def _mismatches(ours: Any, theirs: Any, path: str) -> list[str]:
    found = []
    for f in ours.fields:
        tf = theirs.fields_by_name.get(f.name)
        if tf is None:
            found.append(f"{path}.{f.name}: not in Triton's message")
            continue
        if (f.number, f.type, f.is_repeated) != (tf.number, tf.type, tf.is_repeated):
            found.append(f"{path}.{f.name}: ours {f.number}/{f.type}, Triton's {tf.number}/{tf.type}")
        if f.message_type is not None:
            found += _mismatches(f.message_type, tf.message_type, f"{path}.{f.name}")
    return found


def test_every_message_matches_triton_field_by_field() -> None:
    problems: list[str] = []
    for module, theirs in ((grpc_service_pb2, triton_service), (model_config_pb2, triton_config)):
        for name, desc in module.DESCRIPTOR.message_types_by_name.items():
            problems += _mismatches(desc, theirs.DESCRIPTOR.message_types_by_name[name], name)
    assert problems == []


def test_datatype_enum_matches_triton() -> None:
    for name, value in model_config_pb2.DataType.items():
        assert triton_config.DataType.Value(name) == value


def test_service_methods_match_triton() -> None:
    ours = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton_service.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in ours.methods:
        other = theirs.methods_by_name[method.name]
        assert method.input_type.full_name == other.input_type.full_name
        assert method.output_type.full_name == other.output_type.full_name
    assert ours.full_name == "inference.GRPCInferenceService"
    assert grpc_service_pb2_grpc.GRPCInferenceServiceStub is not None


def test_bytes_cross_between_the_two_copies() -> None:
    theirs = triton_service.ModelInferRequest(model_name="mlp", raw_input_contents=[b"\x00\x01"])
    theirs.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    ours = grpc_service_pb2.ModelInferRequest.FromString(theirs.SerializeToString())
    assert ours.model_name == "mlp"
    assert list(ours.inputs[0].shape) == [1, 2]
    assert ours.raw_input_contents[0] == b"\x00\x01"
