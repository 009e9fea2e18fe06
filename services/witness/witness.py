"""The audit witness: it countersigns metering's audit head (seq, digest) with a key metering
never holds, and keeps every head it signed in its own append-only store.

Modelled on Certificate Transparency witness co-signing (RFC 9162 §8.2, the C2SP
tlog-witness): the witness refuses a head with a lower seq than the newest it signed (even one it signed
before), and
a different digest at a seq it already signed (a split view), so a log that cut its tail
or rewrote history cannot get a fresh countersignature, and the newest one it already has
names rows the chain must still hold.

- key: an Ed25519 private key (`cryptography`), `witness.key` in the witness's folder,
  0600 in a 0700 folder, created on first start; the public key is `witness.pub` (hex).
- store: `heads.jsonl`, one line per signed head, appended and fsynced before answering.
- the signed bytes: `switchyard-witness-v1\\n<log>\\n<seq>\\n<digest>\\n`.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

CONTEXT = "switchyard-witness-v1"


@dataclass(frozen=True)
class Cosigned:
    log: str
    seq: int
    digest: str
    signature: str  # hex Ed25519 signature over signed_bytes(log, seq, digest)


class Refused(Exception):
    """The head contradicts one the witness already signed (lower seq, or a split view)."""


def signed_bytes(log: str, seq: int, digest: str) -> bytes:
    return f"{CONTEXT}\n{log}\n{seq}\n{digest}\n".encode()


def check_signature(public_hex: str, head: Cosigned) -> bool:
    """Whether `head` carries the witness's signature (the check metering's verify makes)."""
    from cryptography.exceptions import InvalidSignature

    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex))
        key.verify(bytes.fromhex(head.signature), signed_bytes(head.log, head.seq, head.digest))
    except (InvalidSignature, ValueError):
        return False
    return True


def _private_folder(folder: Path) -> None:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)


def load_or_create_key(folder: Path) -> Ed25519PrivateKey:
    _private_folder(folder)
    path = folder / "witness.key"
    if not path.exists():
        raw = Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, raw.hex().encode() + b"\n")
        finally:
            os.close(fd)
    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(path.read_text().strip()))
    pub = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    (folder / "witness.pub").write_text(pub + "\n")
    return key


class Witness:
    """The store and the key; one lock orders countersignatures (a witness is not hot)."""

    def __init__(self, folder: Path) -> None:
        self.key = load_or_create_key(folder)
        self.public_hex = self.key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
        self.store = folder / "heads.jsonl"
        self._lock = threading.Lock()
        self._heads: dict[str, dict[int, Cosigned]] = {}
        self._latest: dict[str, Cosigned] = {}
        if self.store.exists():
            for line in self.store.read_text().splitlines():
                if line.strip():
                    self._remember(Cosigned(**json.loads(line)))
        else:
            fd = os.open(self.store, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)

    def _remember(self, head: Cosigned) -> None:
        self._heads.setdefault(head.log, {})[head.seq] = head
        if head.log not in self._latest or head.seq > self._latest[head.log].seq:
            self._latest[head.log] = head

    def latest(self, log: str) -> Cosigned | None:
        with self._lock:
            return self._latest.get(log)

    def cosign(self, log: str, seq: int, digest: str) -> Cosigned:
        """Countersign (log, seq, digest), or Refused naming the head it contradicts."""
        if not log or seq < 1 or len(digest) != 64:
            raise ValueError("a head needs a log name, seq >= 1 and a 64-hex-digit digest")
        with self._lock:
            newest = self._latest.get(log)
            if newest is not None and seq < newest.seq:  # even a head it signed once: it moved on
                raise Refused(f"seq {seq} is below seq {newest.seq}, which this witness already signed")
            known = self._heads.get(log, {}).get(seq)
            if known is not None:
                if known.digest != digest:
                    raise Refused(f"seq {seq} was signed with digest {known.digest[:16]}...: a split view")
                return known
            signature = self.key.sign(signed_bytes(log, seq, digest)).hex()
            head = Cosigned(log, seq, digest, signature)
            with self.store.open("a", encoding="utf-8") as f:
                f.write(json.dumps(asdict(head), sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self._remember(head)
            return head
