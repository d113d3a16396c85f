"""benchmarks/serve.py's load client reads what a server sends, however it frames it: it writes
HTTP/1.1 itself, so each framing a server may use (chunked with events split across chunks,
Content-Length, closed connection) is checked here against a scripted server, as is the
request it writes and an error status."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _serve_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "serve_benchmark", ROOT / "benchmarks" / "serve.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SERVE = _serve_module()

# four events with text, one with none (a token whose text is held back), the end marker
EVENTS = [{"choices": [{"text": t}]} for t in ("Hel", "lo", "", " wor", "ld")]
SSE = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in EVENTS) + b"data: [DONE]\n\n"


def _chunked(body: bytes, size: int) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def _exchange(framing: str, status: int = 200) -> tuple[dict, bytes, list[float] | Exception]:
    """One request of the client to a server that answers with ``framing``: what the server
    read (headers, body) and the client's stamps (or its error)."""
    seen: dict = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        seen["request_line"] = lines[0]
        seen["headers"] = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)
        }
        seen["body"] = await reader.readexactly(int(seen["headers"]["content-length"]))
        reason = b"OK" if status == 200 else b"Bad Request"
        writer.write(b"HTTP/1.1 %d %s\r\ncontent-type: text/event-stream\r\n" % (status, reason))
        body = SSE if status == 200 else b'{"error": {"message": "bad"}}'
        if framing == "chunked":
            writer.write(b"transfer-encoding: chunked\r\n\r\n")
            for i in range(0, len(body), 7):  # (events split mid-line across chunks)
                writer.write(_chunked(body[i : i + 7], 7)[: -len(b"0\r\n\r\n")])
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        elif framing == "length":
            writer.write(b"content-length: %d\r\n\r\n" % len(body) + body)
        else:  # (the end of the body is the connection's)
            writer.write(b"connection: close\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    payload = {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
    out: dict = {}
    result: list[float] | Exception
    try:
        await SERVE._one(f"http://127.0.0.1:{port}", payload, 0.0, out)
        result = out["stamps"]
    except RuntimeError as e:
        result = e
    finally:
        server.close()
        await server.wait_closed()
    return seen, json.dumps(payload).encode(), result


@pytest.mark.parametrize("framing", ["chunked", "length", "close"])
def test_the_client_counts_the_tokens_with_text_whatever_the_framing(framing: str) -> None:
    seen, sent, stamps = asyncio.run(_exchange(framing))
    assert seen["request_line"] == "POST /v1/completions HTTP/1.1"
    assert seen["headers"]["content-type"] == "application/json"
    assert json.loads(seen["body"]) == json.loads(sent)
    assert isinstance(stamps, list)
    assert len(stamps) == sum(1 for e in EVENTS if e["choices"][0]["text"])  # (4: not the empty)
    assert stamps == sorted(stamps) and stamps[0] > 0


def test_an_error_status_is_an_error_naming_it() -> None:
    _, _, err = asyncio.run(_exchange("length", status=400))
    assert isinstance(err, RuntimeError)
    assert str(err).startswith("HTTP 400: ") and "bad" in str(err)
