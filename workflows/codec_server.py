"""The Temporal UI's codec endpoint: `python -m workflows.codec_server --key-file F --origin URL`.

Temporal's codec server protocol (the UI's `--ui-codec-endpoint`): POST `.../encode` and
`.../decode`, each a `Payloads` message in protobuf's JSON form (`{"payloads": [...]}`) in and
out; only the last part of the path counts. The keys are the worker's
(workflows/temporal_codec.py). The UI calls it from the browser, so it answers CORS for the
UI's origin only (`--origin`): a page from any other origin gets no `Access-Control-Allow-*`
header, and the browser keeps the answer from it. `switchyard up` binds it to the UI's host.
GET /healthz answers 200 (what `switchyard up` probes). Bodies are capped at 4 MiB.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads

from switchyard import net
from workflows.temporal_codec import CodecKeyError, Keyring, decrypt, encrypt

log = logging.getLogger(__name__)
MAX_BODY = 4 << 20
ALLOWED_HEADERS = "Content-Type, X-Namespace, Authorization"


def make_handler(keyring: Keyring, origin: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = 10  # a slow client never holds a thread for long

        def _cors(self) -> None:
            if origin and self.headers.get("Origin") == origin:
                self.send_header("Access-Control-Allow-Origin", origin)
                self.send_header("Access-Control-Allow-Methods", "POST, OPTIONS")
                self.send_header("Access-Control-Allow-Headers", ALLOWED_HEADERS)
                self.send_header("Access-Control-Allow-Credentials", "true")
                self.send_header("Vary", "Origin")

        def _answer(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self._cors()
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_OPTIONS(self) -> None:
            self._answer(200, b"", "text/plain")

        def do_GET(self) -> None:
            if urlparse(self.path).path == "/healthz":
                self._answer(200, b'{"ok": true}')
            else:
                self._answer(404, b'{"error": "no such path"}')

        def do_POST(self) -> None:
            action = urlparse(self.path).path.rstrip("/").rsplit("/", 1)[-1]
            if action not in ("encode", "decode"):
                self._answer(404, b'{"error": "POST .../encode or .../decode"}')
                return
            size = int(self.headers.get("Content-Length") or 0)
            if size <= 0 or size > MAX_BODY:
                self._answer(400, b'{"error": "a body of 1 byte to 4 MiB is needed"}')
                return
            self._answer(*answer(keyring, action, self.rfile.read(size)))

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format, *args)

    return Handler


def answer(keyring: Keyring, action: str, body: bytes) -> tuple[int, bytes]:
    """The status and JSON body for one /encode or /decode of `body`."""
    try:
        payloads = json_format.Parse(body, Payloads())
        done = (encrypt if action == "encode" else decrypt)(keyring, payloads.payloads)
    except json_format.ParseError:
        return 400, b'{"error": "not a Payloads message in protobuf JSON"}'
    except CodecKeyError as exc:
        log.warning("codec %s refused: %s", action, exc)
        return 400, json.dumps({"error": str(exc)}).encode()
    return 200, json_format.MessageToJson(Payloads(payloads=done)).encode()


def serve(keyring: Keyring, origin: str, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """The server, bound (call serve_forever); its port is server.server_address[1]."""
    return ThreadingHTTPServer((host, port), make_handler(keyring, origin))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workflows.codec_server", description=__doc__)
    parser.add_argument("--key-file", required=True, type=Path, help="the payload codec's keys")
    parser.add_argument(
        "--origin", required=True, help="the Temporal UI's origin, e.g. http://127.0.0.1:8233"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8234)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    try:
        keyring = Keyring.load(args.key_file)
    except CodecKeyError as exc:
        print(f"codec endpoint not started: {exc}", file=sys.stderr)
        return 2
    server = serve(keyring, args.origin, args.host, args.port)
    where = f"{args.host}:{server.server_address[1]}"
    print(f"codec endpoint on {where} for {args.origin}, {len(keyring.keys)} key(s)", flush=True)
    net.serve_http_until_stopped(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
