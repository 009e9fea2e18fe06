"""Temporal payloads encrypted at rest: an AES-256-GCM `PayloadCodec` and the keys it uses.

Everything the worker and its clients hand Temporal passes the codec: workflow input (the spec),
activity inputs and results (grants among them), heartbeats, queries, the report and the memo
(the SDK encodes memo values with the codec too). The Temporal server, its database and anyone
who reads a history with a plain client see `binary/encrypted` payloads; the Temporal UI reads
them through the codec endpoint `switchyard up` serves (workflows/codec_server.py).

Each encrypted payload is the whole original payload (metadata and data, serialised), sealed
with AES-GCM under a random 96-bit nonce: `nonce || ciphertext+tag`. Its metadata says
`encoding: binary/encrypted` and `encryption-key-id: <id>`; the key id is also the AEAD's
associated data, so a payload cannot be relabelled to another key.

The key file (`--codec-key-file`, SWITCHYARD_TEMPORAL_CODEC_KEY_FILE) holds one key a line,
`<key id> <base64 of 32 bytes>`, `#` comments allowed. The first key encrypts; every key listed
decrypts, so a key rotates by putting a new line first and removing the old one once no history
that needs it is kept (docs/runbook.md). `switchyard up` makes the file, 0600 in a 0700 folder
(`ensure_key_file`); on Kubernetes it is a Secret. A payload not encrypted (what the Temporal UI
or `temporal workflow start` sends) decodes unchanged; one under a key the file lacks is an
error that names the key id. Nothing here logs key material.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from temporalio.api.common.v1 import Payload
from temporalio.converter import DataConverter, DefaultFailureConverterWithEncodedAttributes, PayloadCodec

from workflows.spec.trial_io import TRIAL_CONVERTER

KEY_FILE_ENV = "SWITCHYARD_TEMPORAL_CODEC_KEY_FILE"
ENCODING = b"binary/encrypted"
KEY_ID = "encryption-key-id"
KEY_BYTES = 32
NONCE_BYTES = 12


class CodecKeyError(ValueError):
    """A key file that cannot be used, or a payload no key in it opens."""


@dataclass(frozen=True)
class Keyring:
    """The codec's keys: `current` encrypts, every one of `keys` decrypts."""

    current: str
    keys: dict[str, bytes] = field(repr=False)
    path: Path | None = None

    @classmethod
    def parse(cls, text: str, path: Path | None = None) -> Keyring:
        where = str(path or "the key text")
        keys: dict[str, bytes] = {}
        order: list[str] = []
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise CodecKeyError(f"{where} line {number}: write '<key id> <base64 of 32 bytes>'")
            key_id, encoded = parts
            try:
                key = base64.b64decode(encoded, validate=True)
            except binascii.Error:
                raise CodecKeyError(f"{where} line {number}: key {key_id!r} is not base64") from None
            if len(key) != KEY_BYTES:
                raise CodecKeyError(f"{where} line {number}: key {key_id!r} is {len(key)} bytes, not 32")
            if key_id in keys:
                raise CodecKeyError(f"{where} line {number}: key id {key_id!r} appears twice")
            keys[key_id] = key
            order.append(key_id)
        if not order:
            raise CodecKeyError(f"{where} holds no key; write '<key id> <base64 of 32 bytes>'")
        return cls(order[0], keys, path)

    @classmethod
    def load(cls, path: Path) -> Keyring:
        try:
            text = path.read_text()
        except OSError as exc:
            raise CodecKeyError(f"cannot read codec key file {path} ({exc.strerror})") from None
        return cls.parse(text, path)


def new_key_line(key_id: str) -> str:
    """One line of a key file: a fresh random key under `key_id`."""
    return f"{key_id} {base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode()}\n"


def ensure_key_file(path: Path) -> Path:
    """The key file at `path`, made with one fresh key (id `k1`) if absent: 0600, in a folder
    made 0700 if this makes it (an existing folder keeps its mode)."""
    if path.exists():
        return path
    if not path.parent.exists():
        path.parent.mkdir(parents=True)
        os.chmod(path.parent, 0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write("# Temporal payload codec keys: the first encrypts, all decrypt (docs/runbook.md)\n")
        out.write(new_key_line("k1"))
    os.replace(tmp, path)
    return path


def encrypt(keyring: Keyring, payloads: Sequence[Payload]) -> list[Payload]:
    """Each payload sealed under the current key (see the module docstring)."""
    aead = AESGCM(keyring.keys[keyring.current])
    label = keyring.current.encode()
    out = []
    for payload in payloads:
        nonce = secrets.token_bytes(NONCE_BYTES)
        sealed = nonce + aead.encrypt(nonce, payload.SerializeToString(), label)
        out.append(Payload(metadata={"encoding": ENCODING, KEY_ID: label}, data=sealed))
    return out


def decrypt(keyring: Keyring, payloads: Sequence[Payload]) -> list[Payload]:
    """Each encrypted payload opened with the key its metadata names; others unchanged."""
    out = []
    for payload in payloads:
        if payload.metadata.get("encoding") != ENCODING:
            out.append(payload)
            continue
        key_id = payload.metadata.get(KEY_ID, b"").decode(errors="replace")
        key = keyring.keys.get(key_id)
        if key is None:
            raise CodecKeyError(f"payload encrypted under key {key_id[:64]!r}, not in the codec key file")
        nonce, sealed = payload.data[:NONCE_BYTES], payload.data[NONCE_BYTES:]
        try:
            plain = AESGCM(key).decrypt(nonce, sealed, key_id.encode())
        except InvalidTag:
            raise CodecKeyError(
                f"payload under key {key_id[:64]!r} does not open: altered or another key"
            ) from None
        opened = Payload()
        opened.ParseFromString(plain)
        out.append(opened)
    return out


class EncryptionCodec(PayloadCodec):
    """The codec the worker's and every client's data converter carry."""

    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return encrypt(self.keyring, payloads)

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return decrypt(self.keyring, payloads)


def trial_converter(codec: PayloadCodec | None) -> DataConverter:
    """The trial's data converter (workflows/spec/trial_io.py) with `codec` (None: plaintext).
    With a codec, failures' messages and stack traces are payloads too, and sealed: a refusal
    names the spec's executors and models."""
    if codec is None:
        return TRIAL_CONVERTER
    return dataclasses.replace(
        TRIAL_CONVERTER,
        payload_codec=codec,
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )


def codec_from_file(path: str | Path | None) -> EncryptionCodec | None:
    """The codec for the key file at `path` (None or "": no codec)."""
    return EncryptionCodec(Keyring.load(Path(path))) if path else None
