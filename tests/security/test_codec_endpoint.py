"""The Temporal UI's codec endpoint (workflows/codec_server.py), served for real on port 0 with
a key file made as `switchyard up` makes it: /decode opens what the worker's codec sealed,
/encode seals what the worker opens, and only the UI's origin gets CORS headers."""

from __future__ import annotations

import json
import stat
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import json_format
from temporalio.api.common.v1 import Payload, Payloads

from workflows.codec_server import serve
from workflows.temporal_codec import ENCODING, Keyring, decrypt, encrypt, ensure_key_file, new_key_line

UI = "http://127.0.0.1:8233"
GRANT = b'"grant:v1.secret-grant-body"'


@pytest.fixture
def keyring(tmp_path: Path) -> Keyring:
    path = ensure_key_file(tmp_path / "keys" / "temporal-codec.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    return Keyring.load(path)


@pytest.fixture
def endpoint(keyring: Keyring) -> Iterator[str]:
    server = serve(keyring, UI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _post(url: str, payloads: list[Payload], origin: str = UI) -> tuple[int, dict[str, str], bytes]:
    body = json_format.MessageToJson(Payloads(payloads=payloads)).encode()
    headers = {"Content-Type": "application/json", "Origin": origin, "X-Namespace": "default"}
    request = urllib.request.Request(url, body, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _plain() -> Payload:
    return Payload(metadata={"encoding": b"json/plain"}, data=GRANT)


def test_decode_opens_a_sealed_payload_for_the_ui_origin(keyring: Keyring, endpoint: str) -> None:
    sealed = encrypt(keyring, [_plain()])
    assert GRANT not in sealed[0].data and sealed[0].metadata["encoding"] == ENCODING
    status, headers, body = _post(f"{endpoint}/decode", sealed)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == UI
    (opened,) = json_format.Parse(body, Payloads()).payloads
    assert opened.data == GRANT and opened.metadata["encoding"] == b"json/plain"
    # the path's last part decides (the UI may mount it deeper); encode seals for the worker
    status, _, body = _post(f"{endpoint}/api/default/encode", [_plain()])
    (resealed,) = json_format.Parse(body, Payloads()).payloads
    assert status == 200 and GRANT not in resealed.data
    assert decrypt(keyring, [resealed])[0].data == GRANT


def test_another_origin_gets_no_cors_header(keyring: Keyring, endpoint: str) -> None:
    status, headers, _ = _post(f"{endpoint}/decode", encrypt(keyring, [_plain()]), origin="http://evil.test")
    assert status == 200 and not any(h.lower().startswith("access-control-") for h in headers)
    for origin, allowed in ((UI, True), ("http://evil.test", False), ("http://127.0.0.1:8234", False)):
        request = urllib.request.Request(f"{endpoint}/decode", method="OPTIONS", headers={"Origin": origin})
        with urllib.request.urlopen(request, timeout=5) as reply:
            assert (reply.headers.get("Access-Control-Allow-Origin") == origin) is allowed
            assert ("X-Namespace" in (reply.headers.get("Access-Control-Allow-Headers") or "")) is allowed


def test_an_altered_payload_or_an_unknown_key_is_refused(keyring: Keyring, endpoint: str) -> None:
    (sealed,) = encrypt(keyring, [_plain()])
    altered = Payload(metadata=dict(sealed.metadata), data=sealed.data[:-1] + bytes([sealed.data[-1] ^ 1]))
    status, _, body = _post(f"{endpoint}/decode", [altered])
    assert status == 400 and "does not open" in json.loads(body)["error"]
    other = Keyring.parse(new_key_line("k9"))
    status, _, body = _post(f"{endpoint}/decode", encrypt(other, [_plain()]))
    assert status == 400 and "'k9', not in the codec key file" in json.loads(body)["error"]


def test_a_rotated_key_file_seals_with_the_new_key_and_opens_the_old(keyring: Keyring) -> None:
    old = encrypt(keyring, [_plain()])
    assert keyring.path is not None
    rotated = Keyring.parse(new_key_line("k2") + keyring.path.read_text())
    assert rotated.current == "k2"
    (new,) = encrypt(rotated, [_plain()])
    assert new.metadata["encryption-key-id"] == b"k2"
    assert decrypt(rotated, old)[0].data == GRANT == decrypt(rotated, [new])[0].data
    # a payload relabelled to another key id does not open: the id is the AEAD's associated data
    relabelled = Payload(metadata={**dict(new.metadata), "encryption-key-id": b"k1"}, data=new.data)
    with pytest.raises(ValueError, match="does not open"):
        decrypt(rotated, [relabelled])
