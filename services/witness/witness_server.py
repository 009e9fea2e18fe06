"""The witness's process: `python -m services.witness --dir DIR --port N` (HTTP, JSON).

- POST /v1/cosign {"log", "seq", "digest"}: 200 with the countersigned head, 409 when it
  contradicts one already signed (lower seq, or another digest at a signed seq), 400 when
  malformed;
- GET /v1/latest?log=NAME: 200 with the newest countersigned head, 404 when none;
- GET /healthz: 200 with its public key (what `switchyard up` probes).

It runs as its own process with its own key and folder; metering holds only its public key
(`witness.pub`). Bodies are capped at 4 KiB. The witness binds to 127.0.0.1 by default.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from services.witness.witness import Refused, Witness
from switchyard import net

log = logging.getLogger(__name__)
MAX_BODY = 4096


def make_handler(witness: Witness) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = 5  # a slow client never holds a thread for long

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path == "/healthz":
                self._answer(200, {"ok": True, "key": witness.public_hex})
                return
            if url.path != "/v1/latest":
                self._answer(404, {"error": f"no such path {url.path[:64]}"})
                return
            name = parse_qs(url.query).get("log", [""])[0]
            head = witness.latest(name)
            if head is None:
                self._answer(404, {"error": f"no head signed for log {name[:64]!r}"})
            else:
                self._answer(200, asdict(head))

        def do_POST(self) -> None:
            if urlparse(self.path).path != "/v1/cosign":
                self._answer(404, {"error": "no such path"})
                return
            size = int(self.headers.get("Content-Length") or 0)
            if size <= 0 or size > MAX_BODY:
                self._answer(400, {"error": f"a body of 1..{MAX_BODY} bytes is needed"})
                return
            try:
                raw = json.loads(self.rfile.read(size))
                head = witness.cosign(str(raw["log"]), int(raw["seq"]), str(raw["digest"]))
            except Refused as exc:
                log.warning("refused a head: %s", exc)
                self._answer(409, {"error": str(exc)})
                return
            except (ValueError, KeyError, TypeError) as exc:
                self._answer(400, {"error": f"malformed head: {exc}"})
                return
            self._answer(200, asdict(head))

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format, *args)

    return Handler


def serve(folder: Path, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """The server, bound (call serve_forever); its port is server.server_address[1]."""
    return ThreadingHTTPServer((host, port), make_handler(Witness(folder)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.witness", description=__doc__)
    parser.add_argument("--dir", required=True, type=Path, help="the witness's own folder (key, heads)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8209)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    server = serve(args.dir, args.host, args.port)
    public = (args.dir / "witness.pub").read_text().strip()
    print(f"witness serving on {args.host}:{server.server_address[1]} key {public}", flush=True)
    net.serve_http_until_stopped(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
