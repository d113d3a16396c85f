"""The HTTP/1.1 protocol under `inferflow serve`: uvicorn's httptools protocol (a C parser: less
of the cores the steps share goes to parsing and framing; what vLLM serves with) with the
request head bounded, else (httptools not installed) uvicorn's h11 protocol.

uvicorn's h11 protocol refuses a request line and headers past h11's 16 KiB with a 400; its
httptools protocol buffers any size (a 50 MB header grew the server by ~150 MB, and the request
was served). ``BoundedHttpTools`` answers a head past ``HEAD_LIMIT`` bytes with a 400 naming the
limit and closes the connection, after buffering at most one read more."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

HEAD_LIMIT = 16 * 1024  # bytes of a request's line and headers (h11's default, as before)


def http_protocol() -> Any:
    """What ``uvicorn.Config(http=...)`` takes: ``BoundedHttpTools``, or "h11"."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # (httptools absent)
        return "h11"

    class BoundedHttpTools(HttpToolsProtocol):
        """uvicorn's httptools protocol; bytes received while a request's head is incomplete
        are counted, and past HEAD_LIMIT the request gets a 400 and the connection closes."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._in_head, self._head_bytes = True, 0
            super().connection_made(transport)

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes = True, 0  # (the next request's head)

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            counted = self._in_head
            super().data_received(data)
            if counted and self._in_head:
                self._head_bytes += len(data)
                if self._head_bytes > HEAD_LIMIT and not self.transport.is_closing():
                    msg = f"Request line and headers over {HEAD_LIMIT} bytes."
                    log.warning("%s", msg)
                    self.send_400_response(msg)

    return BoundedHttpTools
