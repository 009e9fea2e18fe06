"""The ledger's audit trail and its integrity: append, query and verify the keyed chain, sign
its head into the anchor file, have the witness countersign it, and re-anchor after an
investigation (services/metering/integrity.py). Run through the ledger's Transactions
(services/metering/transactions.py); reached as `ledger.audit`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.metering import audit, auditkey, integrity, reports, rowmac, witness_client
from services.metering.auditkey import AnchorError
from services.metering.records import Actor
from services.metering.transactions import Transactions


class AuditTrail:
    """The audit chain, the anchor file (None: none is kept) and the witness (None: none)."""

    def __init__(
        self, tx: Transactions, anchor_path: Path | None, witness: witness_client.WitnessClient | None
    ) -> None:
        self.tx = tx
        self.anchor_path = anchor_path
        self.witness = witness

    def append(
        self, actor: Actor, action: str, resource: str, outcome: str, detail: dict[str, Any]
    ) -> audit.AuditRecord:
        return self.tx.write(
            lambda conn, now: audit.append(conn, actor, action, resource, outcome, now, detail)
        )

    def query(
        self, action: str, principal: str, since_us: int, until_us: int, limit: int
    ) -> list[audit.AuditRecord]:
        reports.check_window(since_us, until_us)
        return audit.query(self.tx.engines.read, action, principal, since_us, until_us, limit)

    def verify(self) -> audit.Verification:
        """The chain's verdict, failing closed on the anchor (services/metering/integrity.py)."""
        verdict = audit.verify(self.tx.engines.read, self.tx.audit_key, self.anchor_path)
        if not verdict.ok:
            return verdict
        with self.tx.engines.read.connect() as conn:
            audit.bind_key(conn, self.tx.audit_key)
            forged = rowmac.forged_rows(conn)
            if forged:
                message = f"rows written behind metering's back: {', '.join(forged[:20])}"
                return audit.Verification(False, verdict.rows_checked, 0, "row", message)
            failure = integrity.unresolved_failure(conn)
            if failure is not None:
                message = f"integrity failure recorded at row {failure[0]}: {failure[1]}"
                return audit.Verification(False, verdict.rows_checked, failure[0], "anchor", message)
            if self.anchor_path is not None:
                try:
                    integrity.check_anchor(
                        conn, self.anchor_path, self.tx.audit_key, self.tx.watch.anchored_seq
                    )
                except AnchorError as exc:
                    return audit.Verification(False, verdict.rows_checked, 0, "anchor", str(exc))
            broken = self._witness_break()
            if broken:
                return audit.Verification(False, verdict.rows_checked, 0, "witness", broken)
        if self.tx.watch.halted:
            return audit.Verification(False, verdict.rows_checked, 0, "anchor", self.tx.watch.halted)
        return verdict

    def _witness_break(self) -> str:
        """The chain against the witness's newest countersigned head ("" when it agrees)."""
        if self.witness is None:
            return ""
        try:
            head = self.witness.latest()
        except witness_client.WitnessUnreachable as exc:  # fail closed: nothing vouches for the tail
            return str(exc)
        with self.tx.engines.read.connect() as conn:
            if head is None:  # a witness with nothing to show for an anchored chain vouches for nothing
                anchored = integrity.was_anchored(conn)
                return (
                    f"the witness has no head of log {self.witness.log}, yet the chain was anchored"
                    if anchored
                    else ""
                )
            return witness_client.chain_break(conn, head)

    def write_anchor(self) -> bool:
        """Sign the committed head into the anchor file (if one is configured and it moved).

        The anchor there is checked first (integrity.check_anchor); one that fails is never
        overwritten: the ledger halts and AnchorError is raised.
        """
        if self.anchor_path is None or self.tx.watch.halted:
            return False
        try:
            with self.tx.engines.read.connect() as conn:
                if not self.tx.watch.marked and (failure := integrity.unresolved_failure(conn)):
                    raise AnchorError(f"integrity failure recorded at row {failure[0]}: {failure[1]}")
                anchor = integrity.check_anchor(
                    conn, self.anchor_path, self.tx.audit_key, self.tx.watch.anchored_seq
                )
        except AnchorError as exc:
            integrity.halt(self.tx.engines.write, self.tx.audit_key, self.tx.watch, str(exc))
            raise
        seq, digest = audit.head(self.tx.engines.read)
        if seq == 0:
            return False
        self._witness(seq, digest)
        written = auditkey.write_anchor(self.anchor_path, self.tx.audit_key, seq, digest, self.tx.clock())
        self.tx.watch.anchored_seq = max(self.tx.watch.anchored_seq, seq)
        if not self.tx.watch.marked:  # the chain remembers that it is anchored, once the file is there
            with self.tx.engines.read.connect() as conn:
                marked = integrity.was_anchored(conn)
            if not marked:
                detail = {"seq": seq, "anchor_found": anchor is not None}
                self.append(integrity.SERVICE, integrity.ANCHORED, "audit/anchor", "ok", detail)
            self.tx.watch.marked = True
        return written

    def _witness(self, seq: int, digest: str) -> None:
        """Have the witness countersign the head before it is anchored; its refusal halts."""
        if self.witness is None or seq <= self.tx.watch.witnessed_seq:
            return
        try:
            self.witness.submit(seq, digest)
        except witness_client.WitnessRefused as exc:
            integrity.halt(self.tx.engines.write, self.tx.audit_key, self.tx.watch, str(exc))
            raise AnchorError(str(exc)) from None
        except witness_client.WitnessUnreachable as exc:  # anchored locally; the next round retries
            integrity.log.warning("audit head not countersigned: %s", exc)
            return
        self.tx.watch.witnessed_seq = seq

    def reanchor(self, actor: Actor, reason: str) -> int:
        """The operator's decision after investigating a failure: the chain as it is now (which
        must walk cleanly) becomes the anchored one. Returns the anchored seq."""
        if self.anchor_path is None:
            raise integrity.IntegrityHalted("no anchor file is configured (SWITCHYARD_AUDIT_ANCHOR)")
        walk = audit.verify(self.tx.engines.read, self.tx.audit_key, None)
        if not walk.ok:
            raise integrity.IntegrityHalted(
                f"the chain itself is broken at seq {walk.first_broken_seq} ({walk.problem}): {walk.message}"
            )
        try:
            old = repr(auditkey.read_anchor(self.anchor_path, self.tx.audit_key))
        except AnchorError as exc:
            old = str(exc)
        detail = {"reason": reason, "previous_anchor": old[:512]}
        rec = self.tx.write(
            lambda conn, now: audit.append(
                conn, actor, integrity.REANCHORED, "audit/anchor", "ok", now, detail
            )
        )
        auditkey.write_anchor(
            self.anchor_path, self.tx.audit_key, rec.seq, rec.hash, self.tx.clock(), force=True
        )
        self.tx.watch.halted, self.tx.watch.anchored_seq = "", rec.seq
        return rec.seq
