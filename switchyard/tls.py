"""Service identity: mutual TLS on every internal hop, and who the caller is.

Every switchyard process holds one certificate, issued by the cluster's CA, whose URI SAN
names it: `spiffe://switchyard/<service>` (router, worker, metering, executor, evaluator,
operator), and whose one DNS SAN is the service's name, `<service>.switchyard.internal`
(`service_name`). Servers require a client certificate from the same CA and read the
caller's identity from it (the gRPC auth context; the TLS peer certificate on frames).
Clients check both ways: every dial names the service it means to reach (`expect`), and TLS
verifies the server's certificate against the CA and that name (gRPC's
`ssl_target_name_override`, the frames' `server_hostname`), whatever host:port it dials. No
certificate carries an address (127.0.0.1, localhost) that others share, so one service's
certificate cannot stand in for another's.

A process finds its certificate in a directory laid out as a Kubernetes TLS Secret (and as
cert-manager writes one): `ca.crt`, `tls.crt`, `tls.key`. `switchyard up` issues a local CA
and one directory per service under `<state_dir>/tls/` (`ensure_local_pki`); in production
the directory is a mounted Secret. The directory comes from `SWITCHYARD_SECURITY_TLS_DIR`.
Plaintext is used only when asked for by name: `SWITCHYARD_SECURITY_INSECURE=true` (the
configuration's `security.insecure = true`, `switchyard up --insecure`); with neither, a
service refuses to start and says which to set. Nothing here logs key material.

The `cryptography` package is needed only to issue certificates (`switchyard up`, in the
main environment); serving and dialing read PEM files, so the XLA environment needs none.
"""

from __future__ import annotations

import datetime
import logging
import os
import ssl
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from switchyard.errors import FailedPrecondition

if TYPE_CHECKING:
    import grpc

log = logging.getLogger(__name__)

SPIFFE_PREFIX = "spiffe://switchyard/"
TLS_DIR_ENV = "SWITCHYARD_SECURITY_TLS_DIR"
INSECURE_ENV = "SWITCHYARD_SECURITY_INSECURE"
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"

# The services of a cluster, by the name in their identity.
ROUTER, WORKER, METERING, EXECUTOR, EVALUATOR, OPERATOR = (
    "router",
    "worker",
    "metering",
    "executor",
    "evaluator",
    "operator",
)
SERVICES = (ROUTER, WORKER, METERING, EXECUTOR, EVALUATOR, OPERATOR)


NAME_SUFFIX = ".switchyard.internal"


def service_id(name: str) -> str:
    """The identity a service's certificate carries: spiffe://switchyard/<name>."""
    return SPIFFE_PREFIX + name


def service_name(service: str) -> str:
    """The DNS name a service's certificate carries and its clients check:
    `<identity>.switchyard.internal`. A name may carry a suffix after '-' (executor-cpu), or
    be a full identity (spiffe://switchyard/metering): the identity is the service's name."""
    identity = service.removeprefix(SPIFFE_PREFIX).split("-", 1)[0]
    if identity not in SERVICES:
        raise ValueError(f"{service!r} names no switchyard service ({', '.join(SERVICES)})")
    return _dns_name(identity)


def _dns_name(identity: str) -> str:
    return identity + NAME_SUFFIX


@dataclass(frozen=True)
class Security:
    """How one process talks: mutual TLS with its certificate, or (asked for) plaintext."""

    insecure: bool
    ca: bytes = b""
    cert: bytes = b""
    key: bytes = b""
    identity: str = ""  # this process's own identity (from its certificate)
    directory: str = ""

    @classmethod
    def plaintext(cls) -> Security:
        return cls(insecure=True)

    @classmethod
    def from_dir(cls, directory: str | Path) -> Security:
        folder = Path(directory)
        try:
            ca, cert, key = ((folder / n).read_bytes() for n in (CA_FILE, CERT_FILE, KEY_FILE))
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot read the TLS certificate in {folder} ({exc.strerror}: {exc.filename}); it "
                f"needs {CA_FILE}, {CERT_FILE} and {KEY_FILE} (a Kubernetes TLS Secret, or what "
                "`switchyard up` issues under <state_dir>/tls/<service>)"
            ) from None
        return cls(False, ca, cert, key, identity_of_pem(cert), str(folder))

    def describe(self) -> str:
        """For the line every service logs at start."""
        if self.insecure:
            return "INSECURE: plaintext, callers are not authenticated (insecure = true)"
        return f"mTLS as {self.identity or '(no identity)'}"


_default: Security | None = None


def set_default(security: Security | None) -> None:
    """The process's security for servers and channels not given one (None: read the environment again)."""
    global _default
    _default = security


def current(env: dict[str, str] | None = None) -> Security:
    """The process's security: set_default's, else from the environment (see the module doc)."""
    if _default is not None and env is None:
        return _default
    env = dict(os.environ) if env is None else env
    directory = env.get(TLS_DIR_ENV, "").strip()
    insecure = env.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes")
    if directory:
        return Security.from_dir(directory)
    if insecure:
        return Security.plaintext()
    raise FailedPrecondition(
        f"no service certificate: set {TLS_DIR_ENV} to a directory with {CA_FILE}, {CERT_FILE} and "
        f"{KEY_FILE} (`switchyard up` issues them), or {INSECURE_ENV}=true for plaintext (tests "
        "and trusted local setups only)"
    )


def resolve(security: Security | None) -> Security:
    return current() if security is None else security


# ---- identities ---------------------------------------------------------------------------------


def identity_of_pem(cert_pem: bytes) -> str:
    """The spiffe://switchyard/ URI SAN of a PEM certificate (else its CN), read with the
    standard library only (the XLA environment has no `cryptography`)."""
    import tempfile

    with tempfile.NamedTemporaryFile("wb", suffix=".pem") as tmp:
        tmp.write(cert_pem)
        tmp.flush()
        try:
            decoded = ssl._ssl._test_decode_cert(tmp.name)  # type: ignore[attr-defined]
        except (ssl.SSLError, OSError) as exc:
            raise FailedPrecondition(f"the certificate is not readable PEM: {exc}") from None
    return identity_of_peercert(decoded)


def identity_of_peercert(peercert: dict[str, Any] | None) -> str:
    """From `SSLSocket.getpeercert()`'s dictionary: the URI SAN under spiffe://switchyard/,
    else the subject's common name; "" when there is none."""
    if not peercert:
        return ""
    for kind, value in peercert.get("subjectAltName", ()):
        if kind == "URI" and str(value).startswith(SPIFFE_PREFIX):
            return str(value)
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


def peer_identity(context: Any) -> str:
    """The caller's identity from a gRPC call's auth context ("" when it showed no certificate)."""
    auth = context.auth_context() or {}
    for value in auth.get("x509_subject_alternative_name", ()):
        text = value.decode() if isinstance(value, bytes) else str(value)
        if text.startswith(SPIFFE_PREFIX):
            return text
    for value in auth.get("x509_common_name", ()):
        return value.decode() if isinstance(value, bytes) else str(value)
    return ""


# ---- gRPC ---------------------------------------------------------------------------------------


def server_credentials(security: Security) -> Any:
    import grpc

    return grpc.ssl_server_credentials(
        [(security.key, security.cert)], root_certificates=security.ca, require_client_auth=True
    )


def channel_credentials(security: Security) -> Any:
    import grpc

    return grpc.ssl_channel_credentials(
        root_certificates=security.ca, private_key=security.key, certificate_chain=security.cert
    )


def aio_channel(
    address: str,
    options: Sequence[tuple[str, Any]] = (),
    security: Security | None = None,
    api_key: str = "",
    interceptors: Sequence[Any] = (),
    *,
    expect: str,
) -> grpc.aio.Channel:
    """A grpc.aio channel to `address`, the service `expect` (metering, executor, ...): mTLS
    with this process's certificate, the server's checked to carry `service_name(expect)`; or
    plaintext where the process is explicitly insecure. With `api_key`, every call on it
    carries `authorization: Bearer <key>`; `interceptors` (e.g. telemetry's) go first."""
    import grpc

    security = resolve(security)
    chain = [*interceptors, *(_bearer_interceptors(api_key) if api_key else ())] or None
    if security.insecure:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=chain)
    return grpc.aio.secure_channel(
        address, channel_credentials(security), options=_expecting(options, expect), interceptors=chain
    )


def _expecting(options: Sequence[tuple[str, Any]], expect: str) -> list[tuple[str, Any]]:
    """`options` with TLS told to check the server's certificate for `expect`'s name, not
    for the host dialed (an address tells nothing about who holds it)."""
    return [*options, ("grpc.ssl_target_name_override", service_name(expect))]


def _bearer_interceptors(key: str) -> list[Any]:
    import grpc

    def with_key(details: Any) -> Any:
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {key}")]
        return (
            details._replace(metadata=metadata)
            if hasattr(details, "_replace")
            else _Details(details, metadata)
        )

    class Unary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            return await continuation(with_key(details), request)

    class Stream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
            return await continuation(with_key(details), request)

    return [Unary(), Stream()]


class _Details:
    """ClientCallDetails with other metadata (grpc.aio's is a namedtuple; this is for others)."""

    def __init__(self, details: Any, metadata: Any) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = details.wait_for_ready


def sync_channel(
    address: str,
    options: Sequence[tuple[str, Any]] = (),
    security: Security | None = None,
    *,
    expect: str,
) -> grpc.Channel:
    """A blocking channel, as aio_channel's (the server checked for `expect`)."""
    import grpc

    security = resolve(security)
    if security.insecure:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, channel_credentials(security), options=_expecting(options, expect))


# ---- frames (plain TCP + ssl) -------------------------------------------------------------------


def _load_chain(ctx: ssl.SSLContext, security: Security) -> None:
    import tempfile

    # ssl reads certificates from files only; the files live for the call (0600, removed)
    with (
        tempfile.NamedTemporaryFile("wb", suffix=".pem") as cert,
        tempfile.NamedTemporaryFile("wb", suffix=".pem") as key,
    ):
        cert.write(security.cert)
        key.write(security.key)
        cert.flush()
        key.flush()
        ctx.load_cert_chain(cert.name, key.name)
    ctx.load_verify_locations(cadata=security.ca.decode())


def server_ssl_context(security: Security) -> ssl.SSLContext | None:
    """For a frames server: require a client certificate from the cluster's CA (None: plaintext)."""
    if security.insecure:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load_chain(ctx, security)
    return ctx


def client_ssl_context(security: Security) -> ssl.SSLContext | None:
    """For a frames client: this process's certificate, the server's checked against the CA
    and against the `server_hostname` of each connection (give `service_name(...)`)."""
    if security.insecure:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, security)
    return ctx


def transport_identity(transport: Any) -> str:
    """The peer's identity on an asyncio TLS transport ("" for plaintext)."""
    return identity_of_peercert(transport.get_extra_info("peercert"))


# ---- issuing (switchyard up) ------------------------------------------------------------------


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, 0o600)


def _issued_for(folder: Path, name: str) -> bool:
    """Whether `folder` holds a certificate whose DNS SAN is `name`. One issued before
    services had names (for 127.0.0.1 and localhost, which every service shared) is not."""
    from cryptography import x509

    if not all((folder / n).exists() for n in (CA_FILE, CERT_FILE, KEY_FILE)):
        return False
    cert = x509.load_pem_x509_certificate((folder / CERT_FILE).read_bytes())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    return name in sans.get_values_for_type(x509.DNSName)


def ensure_local_pki(root: Path, services: Iterable[str]) -> dict[str, Path]:
    """A local CA under `root/ca` and a certificate directory per service under `root/<name>`,
    created on first use and kept after (every file 0600, every directory 0700). A service
    name may carry a suffix after '-' (executor-cpu): the identity is the part before it. Each
    certificate carries the identity's SPIFFE URI and its name (`service_name`), nothing else:
    no address, so no two services' certificates answer to the same name.
    Returns each service's directory."""
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    ca_dir = root / "ca"
    ca_dir.mkdir(exist_ok=True)
    os.chmod(ca_dir, 0o700)
    if not (ca_dir / "ca.key").exists() or not (ca_dir / CA_FILE).exists():
        _issue_ca(ca_dir)
    out: dict[str, Path] = {}
    for name in services:
        folder = root / name
        out[name] = folder
        identity = name.split("-", 1)[0]
        if _issued_for(folder, _dns_name(identity)):
            continue
        folder.mkdir(exist_ok=True)
        os.chmod(folder, 0o700)
        _issue_service(ca_dir, folder, name)
    return out


def _issue_ca(ca_dir: Path) -> None:
    """A self-signed CA key and certificate (ten years, no intermediates below it)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    pem = serialization.Encoding.PEM
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "switchyard local CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _write_private(ca_dir / "ca.key", key_pem)
    _write_private(ca_dir / CA_FILE, ca_cert.public_bytes(pem))


def _issue_service(ca_dir: Path, folder: Path, name: str) -> None:
    """`name`'s key and certificate, signed by the CA in `ca_dir`, into `folder` with the CA's:
    its SPIFFE ID as the URI SAN and its identity's name (`service_name`) as the one DNS SAN."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca_pem = (ca_dir / CA_FILE).read_bytes()
    ca_cert = x509.load_pem_x509_certificate(ca_pem)
    now = datetime.datetime.now(datetime.UTC)
    pem = serialization.Encoding.PEM
    identity = name.split("-", 1)[0]
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(service_id(identity)),
        x509.DNSName(_dns_name(identity)),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, service_id(identity))]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=825))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(folder / CA_FILE, ca_pem)
    _write_private(folder / CERT_FILE, cert.public_bytes(pem))
    _write_private(
        folder / KEY_FILE,
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
