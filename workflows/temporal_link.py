"""How a process reaches Temporal: address, namespace, TLS where the cluster offers it, and the
payload codec's key file (workflows/temporal_codec.py). Parsed once at the edge: from the
worker's and the trial CLI's flags, whose defaults are these environment variables:

- SWITCHYARD_TEMPORAL_TLS_CA: the CA the Temporal frontend's certificate is checked against;
  setting it (or SWITCHYARD_TEMPORAL_TLS=true, for a CA the system trusts) turns TLS on;
- SWITCHYARD_TEMPORAL_TLS_CERT, SWITCHYARD_TEMPORAL_TLS_KEY: a client certificate and its key,
  for a cluster that asks for mTLS;
- SWITCHYARD_TEMPORAL_TLS_SERVER_NAME: the name the server's certificate must carry, when the
  address dialled is not it;
- SWITCHYARD_TEMPORAL_CODEC_KEY_FILE: the codec's keys.

With TLS on, every connection to Temporal uses it and none falls back to plaintext.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from temporalio.converter import DataConverter
from temporalio.service import TLSConfig

from workflows.temporal_codec import KEY_FILE_ENV, codec_from_file, trial_converter

TLS_ENV = "SWITCHYARD_TEMPORAL_TLS"
CA_ENV = "SWITCHYARD_TEMPORAL_TLS_CA"
CERT_ENV = "SWITCHYARD_TEMPORAL_TLS_CERT"
KEY_ENV = "SWITCHYARD_TEMPORAL_TLS_KEY"
SERVER_NAME_ENV = "SWITCHYARD_TEMPORAL_TLS_SERVER_NAME"


class TemporalLinkError(ValueError):
    """A TLS setting that cannot be used (a missing file, a certificate without its key)."""


@dataclass(frozen=True)
class TemporalTLS:
    enabled: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    @classmethod
    def of(
        cls,
        ca_file: str = "",
        cert_file: str = "",
        key_file: str = "",
        server_name: str = "",
        on: bool = False,
    ) -> TemporalTLS:
        if bool(cert_file) != bool(key_file):
            raise TemporalLinkError("a Temporal client certificate needs its key, and a key its certificate")
        return cls(bool(on or ca_file or cert_file), ca_file, cert_file, key_file, server_name)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TemporalTLS:
        env = os.environ if env is None else env
        return cls.of(
            env.get(CA_ENV, ""),
            env.get(CERT_ENV, ""),
            env.get(KEY_ENV, ""),
            env.get(SERVER_NAME_ENV, ""),
            on=env.get(TLS_ENV, "").lower() in ("1", "true", "yes"),
        )

    def env(self) -> dict[str, str]:
        """These settings as the environment a child process reads them from."""
        if not self.enabled:
            return {}
        pairs = {CA_ENV: self.ca_file, CERT_ENV: self.cert_file, KEY_ENV: self.key_file}
        out = {name: str(Path(value).resolve()) for name, value in pairs.items() if value}
        if self.server_name:
            out[SERVER_NAME_ENV] = self.server_name
        return {TLS_ENV: "true", **out}

    def config(self) -> TLSConfig | bool:
        """The SDK's TLS setting: False (plaintext) when off."""
        if not self.enabled:
            return False
        return TLSConfig(
            server_root_ca_cert=_read(self.ca_file, "CA") if self.ca_file else None,
            client_cert=_read(self.cert_file, "client certificate") if self.cert_file else None,
            client_private_key=_read(self.key_file, "client key") if self.key_file else None,
            domain=self.server_name or None,
        )

    def describe(self) -> str:
        if not self.enabled:
            return "plaintext"
        mutual = "mTLS" if self.cert_file else "TLS"
        name = f", name {self.server_name}" if self.server_name else ""
        return f"{mutual} (CA {self.ca_file or 'system'}{name})"


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TemporalLinkError(f"cannot read the Temporal TLS {what} {path} ({exc.strerror})") from None


@dataclass(frozen=True)
class TemporalLink:
    address: str
    namespace: str = "default"
    tls: TemporalTLS = field(default_factory=TemporalTLS)
    codec_key_file: str = ""

    @classmethod
    def from_env(
        cls, address: str, namespace: str = "default", env: Mapping[str, str] | None = None
    ) -> TemporalLink:
        env = os.environ if env is None else env
        return cls(address, namespace, TemporalTLS.from_env(env), env.get(KEY_FILE_ENV, ""))

    def converter(self) -> DataConverter:
        """The trial converter, with the codec when a key file is named."""
        return trial_converter(codec_from_file(self.codec_key_file))

    def env(self) -> dict[str, str]:
        """The TLS and codec settings as a child process's environment."""
        out = self.tls.env()
        if self.codec_key_file:
            out[KEY_FILE_ENV] = str(Path(self.codec_key_file).resolve())
        return out
