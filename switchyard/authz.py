"""Who may call what: the per-RPC check servers run before a method, and its refusals.

A server given a `Guard` (ServerOptions.guard) asks it before every RPC of its services
(health and reflection excepted): the guard reads the caller's identity from the call's TLS
certificate (switchyard.tls) and answers by raising Unauthenticated (no identity the server
knows) or PermissionDenied (a known identity this method does not accept). Each refusal goes
to the guard's audit sink once, with every string cut to a bounded size, so a refused caller
cannot flood the audit trail. The identity the guard admitted is in `CALLER` for the method
(metering writes it as the actor of audit rows).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from switchyard import tls
from switchyard.errors import PermissionDenied, Unauthenticated

log = logging.getLogger(__name__)

MAX_AUDIT_STRING = 256  # characters of any one audited string (resource, reason, actor...)
MAX_AUDIT_DETAIL = 2048  # characters of an audited detail document


def cap(text: str, limit: int = MAX_AUDIT_STRING) -> str:
    """`text` cut to `limit` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    note = f"...(+{len(text) - limit} chars)"
    return text[: max(0, limit - len(note))] + note


@dataclass(frozen=True)
class Caller:
    identity: str  # spiffe://switchyard/<service>, or "" when the server is insecure
    peer: str  # the transport address, for the audit trail
    insecure: bool = False  # no certificates here: the caller could not be authenticated
    principal: str = ""  # the principal of the API key it presented, where one was checked

    @property
    def actor(self) -> str:
        """Who acts, for the audit trail: the key's principal, else the certificate's identity."""
        return self.principal or self.identity

    @property
    def service(self) -> str:
        """The service name of a cluster identity ("" for any other)."""
        return (
            self.identity.removeprefix(tls.SPIFFE_PREFIX)
            if self.identity.startswith(tls.SPIFFE_PREFIX)
            else ""
        )


CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("switchyard_caller", default=None)


@dataclass(frozen=True)
class Refusal:
    identity: str
    peer: str
    method: str
    status: str  # UNAUTHENTICATED | PERMISSION_DENIED
    reason: str

    def detail_json(self) -> str:
        detail = {"status": self.status, "reason": cap(self.reason, 512), "caller": cap(self.identity)}
        return json.dumps(detail, sort_keys=True)[:MAX_AUDIT_DETAIL]


AuditSink = Callable[[Refusal], None]


class Guard(Protocol):
    async def admit(self, method: str, context: Any) -> None:
        """Returns when the caller may call `method` (full name, /pkg.Service/Method); raises
        Unauthenticated or PermissionDenied (audited) otherwise."""
        ...


def caller_of(context: Any, security: tls.Security) -> Caller:
    peer = str(context.peer() or "")
    if security.insecure:
        return Caller("", peer, insecure=True)
    return Caller(tls.peer_identity(context), peer)


def known(identity: str) -> bool:
    return identity.startswith(tls.SPIFFE_PREFIX) and identity.removeprefix(tls.SPIFFE_PREFIX) in tls.SERVICES


class ServiceGuard:
    """Static rules: method name (the part after the last '/') -> the services allowed to call
    it; methods not named fall to `default` (None: every authenticated caller)."""

    def __init__(
        self,
        security: tls.Security,
        rules: Mapping[str, Collection[str]],
        default: Collection[str] | None,
        audit: AuditSink | None = None,
        what: str = "this service",
    ) -> None:
        self.security = security
        self.rules = {k: frozenset(v) for k, v in rules.items()}
        self.default = None if default is None else frozenset(default)
        self.audit = audit
        self.what = what

    async def admit(self, method: str, context: Any) -> None:
        caller = caller_of(context, self.security)
        CALLER.set(caller)
        if caller.insecure:
            return
        name = method.rsplit("/", 1)[-1]
        allowed = self.rules.get(name, self.default)
        if caller.identity and (allowed is None or caller.service in allowed):
            return
        if not known(caller.identity):
            refusal = Refusal(
                caller.identity,
                caller.peer,
                method,
                "UNAUTHENTICATED",
                f"{caller.identity or 'a caller without an identity'} is not a switchyard service",
            )
            self.refuse(refusal)
            raise Unauthenticated(
                f"{name} needs a switchyard service certificate ({tls.SPIFFE_PREFIX}<service>); "
                f"got {cap(caller.identity, 80) or 'none'}"
            )
        names = ", ".join(sorted(allowed or ()))
        reason = f"{caller.identity} may not call {name} on {self.what} (allowed: {names})"
        self.refuse(Refusal(caller.identity, caller.peer, method, "PERMISSION_DENIED", reason))
        raise PermissionDenied(f"{reason}; call it through the router or the trial worker")

    def refuse(self, refusal: Refusal) -> None:
        log.warning(
            "refused %s from %s (%s): %s",
            refusal.method,
            cap(refusal.identity, 80) or "-",
            refusal.peer,
            refusal.status,
        )
        if self.audit is not None:
            try:
                self.audit(refusal)
            except Exception:  # an audit sink must not turn a refusal into INTERNAL
                log.exception("could not queue the audit of a refusal")


class AuditQueue:
    """Refusals sent to metering's AppendAudit in the background: a bounded queue (full: the
    newest are dropped and counted, never blocking a refusal), one sender task."""

    def __init__(self, send: Callable[[Refusal], Any], source: str, limit: int = 1000) -> None:
        self._send = send
        self.source = source
        self._queue: asyncio.Queue[Refusal] = asyncio.Queue(limit)
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0

    def __call__(self, refusal: Refusal) -> None:
        try:
            self._queue.put_nowait(refusal)
        except asyncio.QueueFull:
            self.dropped += 1
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while not self._queue.empty():
            refusal = self._queue.get_nowait()
            try:
                await self._send(refusal)
            except Exception as exc:  # metering away: the refusal is in this service's log
                log.warning("could not audit a refusal of %s: %s", refusal.method, exc)

    async def flush(self, timeout_s: float = 2.0) -> None:
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except TimeoutError:
                self._task.cancel()


def audit_request(refusal: Refusal, source: str) -> Any:
    """The AppendAudit request recording `refusal` (every string capped)."""
    from switchyard.gen.switchyard.v1 import metering_pb2 as mpb

    return mpb.AppendAuditRequest(
        actor=mpb.Actor(principal=cap(refusal.identity), source=cap(f"{source} {refusal.peer}".strip())),
        action="rpc.denied",
        resource=cap(refusal.method),
        outcome="denied",
        detail_json=refusal.detail_json(),
    )


class MeteringAudit:
    """An audit sink that sends refusals to metering's AppendAudit over this process's channel."""

    def __init__(self, address: str, security: tls.Security, source: str) -> None:
        from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc

        self._channel = tls.aio_channel(address, security=security, expect=tls.METERING)
        self._stub = mgrpc.MeteringStub(self._channel)
        self.queue = AuditQueue(self._send, source)

    async def _send(self, refusal: Refusal) -> None:
        await self._stub.AppendAudit(audit_request(refusal, self.queue.source), timeout=2.0)

    def __call__(self, refusal: Refusal) -> None:
        self.queue(refusal)

    async def close(self) -> None:
        await self.queue.flush()
        await self._channel.close()
