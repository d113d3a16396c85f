"""Graceful shutdown: the first SIGTERM (or Ctrl-C) stops admissions and lets the requests in
flight finish for a grace period; what is still running then ends with finish reason "abort"
(a stream gets its final chunk and ``[DONE]``), and the process exits. A second signal skips
the wait."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from types import FrameType
from typing import Any

import uvicorn

from inferflow.errors import Unavailable
from inferflow.server.http_protocol import http_protocol
from inferflow.server.state import ServerState

log = logging.getLogger(__name__)

# after the abort, how long the aborted responses may take to write their last bytes
FLUSH_SECONDS = 3.0


async def drain(state: ServerState, grace: float, hurry: asyncio.Event) -> None:
    """Refuse new requests (503), wait up to ``grace`` seconds (or until ``hurry`` is set) for
    the requests in flight, then abort the rest and wait for their responses to end."""
    state.draining = True
    log.info(
        "shutting down: new requests get 503; %d in flight may finish within %.0f s",
        state.active,
        grace,
    )
    deadline = time.monotonic() + grace
    while state.active and time.monotonic() < deadline and not hurry.is_set():
        await asyncio.sleep(0.05)
    if state.active and state.runner is not None:
        log.info("aborting the %d requests still in flight", state.active)
        state.runner.abort_all()
        deadline = time.monotonic() + FLUSH_SECONDS
        while state.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with ``drain`` between the first exit signal and uvicorn's own
    shutdown (which would otherwise cut running streams when its timeout ends)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace: float) -> None:
        super().__init__(config)
        self.state, self.grace = state, grace
        self.loop: asyncio.AbstractEventLoop | None = None
        self.hurry: asyncio.Event | None = None

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        self.loop = asyncio.get_running_loop()
        self.hurry = asyncio.Event()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop, hurry = self.loop, self.hurry
        if loop is None or hurry is None or self.should_exit:
            return super().handle_exit(sig, frame)
        if self.state.draining:  # a second signal: abort now
            loop.call_soon_threadsafe(hurry.set)
            return
        self.state.draining = True  # (at once: the task below starts on the loop's next turn)

        def start() -> None:
            task = loop.create_task(drain(self.state, self.grace, hurry))
            task.add_done_callback(lambda _: setattr(self, "should_exit", True))

        loop.call_soon_threadsafe(start)


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now: a port in use fails at once, before the model
    loads (Unavailable: exit status 1), and no other process can take it meanwhile."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds)
            sock.bind(addr)
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
    except OSError as e:
        raise Unavailable(
            f"--port {port}: cannot listen on {host}:{port}: {e.strerror or e} (is another "
            "server running there? choose another --port or --host)"
        ) from None
    return sock


def serve(app: Any, host: str, port: int, grace: float, sock: socket.socket | None = None) -> None:
    """Serve ``app`` (create_app's) until a signal, draining as above; on ``sock`` when given
    (``listen``'s), else on a socket uvicorn binds."""
    # (uvicorn's own shutdown then only closes idle connections: drain ended the requests)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        timeout_graceful_shutdown=5,
        log_level="info",
        http=http_protocol(),
    )
    DrainingServer(config, app.state.inferflow, grace).run(sockets=None if sock is None else [sock])
