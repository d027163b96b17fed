"""An ASGI app served by uvicorn on a free loopback port, in a thread, for tests that need a real HTTP server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from kiln.streams.processes import free_port


@contextmanager
def serving(app: Any, started_within_s: float = 20.0) -> Iterator[str]:
    """Yields the server's base URL once it accepts connections; stops it on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + started_within_s
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
