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
REFUSAL = f"Request line and headers over {HEAD_LIMIT} bytes."


def http_protocol() -> Any:
    """What ``uvicorn.Config(http=...)`` takes: ``BoundedHttpTools``, or "h11"."""
    try:
        import httptools
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # (httptools absent)
        return "h11"

    class BoundedHttpTools(HttpToolsProtocol):
        """uvicorn's httptools protocol, a request's head bounded twice: its URL and headers
        as parsed (a head that arrives whole in one read), and the bytes received while it is
        incomplete (the parser holds a header until its end: one endless header)."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._in_head, self._received, self._parsed, self._refused = True, 0, 0, False
            super().connection_made(transport)

        def on_message_begin(self) -> None:
            self._parsed = 0
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._parse(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._parse(len(name) + len(value) + 4)  # (": " and CRLF)
            super().on_header(name, value)

        def _parse(self, n: int) -> None:
            self._parsed += n
            if self._parsed > HEAD_LIMIT:  # (uvicorn answers the parser's error: a 400)
                self._refused = True
                raise httptools.HttpParserError(REFUSAL)

        def on_headers_complete(self) -> None:
            self._in_head, self._received = False, 0
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head = True  # (the next request's head)

        def send_400_response(self, msg: str) -> None:
            super().send_400_response(REFUSAL if self._refused else msg)

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            if self._in_head:  # (a head that ends in this chunk zeroes the count)
                self._received += len(data)
            super().data_received(data)
            if self._received > HEAD_LIMIT and not self.transport.is_closing():
                log.warning("%s", REFUSAL)
                self._refused = True
                self.send_400_response(REFUSAL)

    return BoundedHttpTools
