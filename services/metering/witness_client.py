"""Metering's side of the audit witness (services/witness/): submit heads, check its signature.

Configured by environment (unset: no witness):
- SWITCHYARD_AUDIT_WITNESS: the witness's address, `http://127.0.0.1:8209`;
- SWITCHYARD_AUDIT_WITNESS_KEY: its Ed25519 public key, hex, or a file holding it
  (`witness.pub` in the witness's folder); metering never holds the private key;
- SWITCHYARD_AUDIT_LOG: this ledger's name at the witness (default `switchyard-ledger`).

Every anchor round submits the head; a refusal (the head is below one already witnessed,
or differs at a witnessed seq) halts the ledger like a failed anchor (integrity.py).
`verify` asks for the newest countersigned head, checks the signature with the public key,
and requires the chain to still hold that row with that digest.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.witness.witness import Cosigned, check_signature

if TYPE_CHECKING:
    from sqlalchemy import Connection

ENV_WITNESS = "SWITCHYARD_AUDIT_WITNESS"
ENV_WITNESS_KEY = "SWITCHYARD_AUDIT_WITNESS_KEY"
ENV_LOG = "SWITCHYARD_AUDIT_LOG"


class WitnessRefused(Exception):
    """The witness refused the head: it contradicts one it already countersigned."""


class WitnessUnreachable(Exception):
    """The witness did not answer, or answered something that is not its signed head."""


@dataclass(frozen=True)
class WitnessClient:
    url: str
    public_hex: str
    log: str = "switchyard-ledger"
    timeout_s: float = 2.0

    @classmethod
    def from_env(cls) -> WitnessClient | None:
        url = os.environ.get(ENV_WITNESS, "").rstrip("/")
        if not url:
            return None
        key = os.environ.get(ENV_WITNESS_KEY, "").strip()
        if not key:
            raise ValueError(f"{ENV_WITNESS} is set but {ENV_WITNESS_KEY} (its public key) is not")
        if not all(c in "0123456789abcdef" for c in key.lower()) or len(key) != 64:
            key = Path(key).read_text().strip()
        return cls(url, key, os.environ.get(ENV_LOG, "") or "switchyard-ledger")

    def _call(self, request: urllib.request.Request) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                return resp.status, json.loads(resp.read(8192))
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read(8192) or b"{}")
        except (OSError, ValueError) as exc:
            raise WitnessUnreachable(f"witness {self.url} did not answer ({exc})") from None

    def _signed(self, body: dict[str, Any]) -> Cosigned:
        try:
            head = Cosigned(str(body["log"]), int(body["seq"]), str(body["digest"]), str(body["signature"]))
        except (KeyError, TypeError, ValueError):
            raise WitnessUnreachable(f"witness {self.url} answered a malformed head") from None
        if head.log != self.log or not check_signature(self.public_hex, head):
            raise WitnessUnreachable(f"witness {self.url} answered a head not signed with its key")
        return head

    def submit(self, seq: int, digest: str) -> Cosigned:
        data = json.dumps({"log": self.log, "seq": seq, "digest": digest}).encode()
        req = urllib.request.Request(
            f"{self.url}/v1/cosign", data, {"Content-Type": "application/json"}, method="POST"
        )
        status, body = self._call(req)
        if status == 409:
            raise WitnessRefused(f"the witness refused head seq {seq}: {body.get('error', '')}")
        if status != 200:
            raise WitnessUnreachable(f"witness {self.url} answered {status}: {body.get('error', '')}")
        head = self._signed(body)
        if (head.seq, head.digest) != (seq, digest):
            raise WitnessUnreachable(f"witness {self.url} signed another head than seq {seq}")
        return head

    def latest(self) -> Cosigned | None:
        query = urllib.parse.urlencode({"log": self.log})
        status, body = self._call(urllib.request.Request(f"{self.url}/v1/latest?{query}"))
        if status == 404:
            return None
        if status != 200:
            raise WitnessUnreachable(f"witness {self.url} answered {status}: {body.get('error', '')}")
        return self._signed(body)


def chain_break(conn: Connection, head: Cosigned) -> str:
    """What is wrong with the chain given the witness's newest head ("" when nothing)."""
    # imported here: `switchyard up` reads this module's variable names before it starts
    # anything, and SQLAlchemy with the ledger's schema took it 1-2 s on a busy host
    from sqlalchemy import select

    from services.metering.schema import AUDIT, HEAD

    head_seq = int(conn.execute(select(HEAD.c.seq).where(HEAD.c.id == 1)).scalar_one())
    if head_seq < head.seq:
        return f"the witness countersigned seq {head.seq}; the audit head is at {head_seq} (the tail was cut)"
    row = conn.execute(select(AUDIT.c.hash).where(AUDIT.c.seq == head.seq)).first()
    if row is None or row.hash != head.digest:
        return f"audit row {head.seq} is gone or differs from the head the witness countersigned"
    return ""
