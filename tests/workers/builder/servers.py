"""An HTTP server on every address of this machine (loopback included) that counts the requests it gets: what a
build must never reach."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

from kiln.streams.processes import free_port


class _Counting(http.server.BaseHTTPRequestHandler):
    hits: ClassVar[list[str]] = []
    body: ClassVar[bytes] = b""

    def do_GET(self) -> None:
        self.hits.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.body)

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def counting_server(body: bytes) -> Iterator[tuple[int, list[str]]]:
    """(port, the paths requested so far), answering ``body`` to each."""
    port = free_port()
    hits: list[str] = []
    server = http.server.ThreadingHTTPServer(("0.0.0.0", port),
                                             type("Handler", (_Counting,), {"hits": hits, "body": body}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield port, hits
    finally:
        server.shutdown()
        server.server_close()
