"""A principal, its roles and a fresh API key, through metering's access API: the one path
the demo's teams and `switchyard up`'s Temporal UI principal are made by."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from switchyard import tls
from switchyard.gen.switchyard.v1 import metering_pb2, metering_pb2_grpc


@dataclass(frozen=True)
class PrincipalKey:
    principal_id: str  # the principal's name where it already existed (metering takes either)
    key_id: str
    key: str  # the full bearer secret; shown once, never logged


async def create_principal_key(
    metering: str,
    name: str,
    grants: Sequence[tuple[str, str]],
    actor: metering_pb2.Actor,
    *,
    kind: str,
    team: str = "",
    existing_ok: bool = False,
) -> PrincipalKey:
    """Principal `name` (with `existing_ok`, an existing one is kept), each (role, scope) of
    `grants` granted to it, and a new key of it."""
    async with tls.aio_channel(metering, expect=tls.METERING) as channel:
        stub = metering_pb2_grpc.MeteringStub(channel)
        try:
            made = await stub.CreatePrincipal(
                metering_pb2.CreatePrincipalRequest(name=name, kind=kind, team=team, actor=actor), timeout=10
            )
            principal = made.principal_id
        except grpc.aio.AioRpcError as err:
            if not existing_ok or err.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
            principal = name
        for role, scope in grants:
            await stub.GrantRole(
                metering_pb2.RoleRequest(principal=principal, role=role, scope=scope, actor=actor), timeout=10
            )
        created = await stub.CreateKey(
            metering_pb2.CreateKeyRequest(principal=principal, actor=actor), timeout=10
        )
    return PrincipalKey(principal, created.key_id, created.key or f"{created.key_id}.{created.secret}")
