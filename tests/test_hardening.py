"""One bad request never hurts another (issue 24), against a real `inferflow serve`: each
reproduction of the outside probe is answered fast with a 400 naming the problem, while
concurrent greedy streams produce exactly the text they produce without the attacker and
/health answers within a second throughout; SIGTERM under 64 streams ends every stream with a
finish reason and ``[DONE]``; a client that disconnects costs one INFO line, not a traceback.

The served spec's chat template is hostile on purpose (a model file's template is untrusted
code): it loops forever, doubles a string, asks for range(10**9) or prints 10**5000 when the
last message says so, and is ChatML otherwise."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from inferflow.server.attacks import ATTACKS, Health, hostile_tokenizer
from tests.conftest import smollm2_path
from tests.serving import check_error, run_server

pytestmark = pytest.mark.slow

SPEC_EXTRA = hostile_tokenizer()
PROMPTS = ["The history of the lighthouse", "A recipe for bread", "Rivers of Europe", "Dear diary"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, int]]:
    smollm2_path()  # skips when the model package is missing
    tmp = tmp_path_factory.mktemp("hardening")
    args = ("--deterministic", "--template-timeout", "1", "--max-waiting", "256")
    with run_server(tmp, *args, spec_extra=SPEC_EXTRA, verbose=True) as (url, proc):
        yield url, next(tmp.glob("server-*.log")), proc.pid


def _stream(url: str, prompt: str, tokens: int = 64) -> tuple[str, str | None, bool]:
    """A greedy streamed completion: (text, finish reason, whether [DONE] came)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    text, reason, done = "", None, False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
    return text, reason, done


def _send(url: str, route: str, body: object) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    if isinstance(body, str):  # raw JSON (what json.dumps cannot write: a lone surrogate)
        r = httpx.post(
            f"{url}{route}", content=body, headers={"content-type": "application/json"}, timeout=30
        )
    else:
        r = httpx.post(f"{url}{route}", json=body, timeout=30)
    return r, time.perf_counter() - t0


def test_every_attack_fails_fast_and_alone(server: tuple[str, Path, int]) -> None:
    url, _, _ = server
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        alone = list(pool.map(lambda p: _stream(url, p), PROMPTS))
    assert all(done and reason == "length" for _, reason, done in alone)
    big = "word " * 800_000  # 4 MB to tokenize, as text and as chat: heavy, off the event loop
    with Health(url) as health, ThreadPoolExecutor(len(PROMPTS) + 2) as pool:
        streams = [pool.submit(_stream, url, p) for p in PROMPTS]
        tokenized = pool.submit(_send, url, "/tokenize", {"prompt": big})
        chat = {"messages": [{"role": "user", "content": big}]}  # through the template worker
        templated = pool.submit(_send, url, "/tokenize", chat)
        time.sleep(0.5)  # (the streams are running)
        for name, a in ATTACKS.items():
            r, took = _send(url, a.route, a.body)
            check_error(r, a.status, *a.words)
            assert took < a.seconds, (name, took)
            assert all(not s.done() for s in streams), f"{name}: the streams ended too soon"
        for heavy in (tokenized, templated):
            r, _ = heavy.result()
            assert r.status_code == 200 and r.json()["count"] >= 800_000
        with_attacker = [s.result() for s in streams]
    assert with_attacker == alone  # greedy and --deterministic: the very same text
    assert health.failures == 0 and health.worst < 1.0, health.worst


def test_the_hostile_template_costs_the_server_nothing(server: tuple[str, Path, int]) -> None:
    """After the template bombs the server's memory has not grown by the doubled string, and
    a normal chat still renders with the model's template (the worker pool recovered)."""
    url, _, pid = server
    psutil = pytest.importorskip("psutil")
    rss = psutil.Process(pid).memory_info().rss
    for content in ("LOOP", "DOUBLE", "RANGE", "BIG"):
        chat = {"messages": [{"role": "user", "content": content}]}
        check_error(_send(url, "/v1/chat/completions", chat)[0], 400, "chat template")
    assert psutil.Process(pid).memory_info().rss - rss < 100 << 20
    chat = {"messages": [{"role": "user", "content": "Name three oceans."}], "max_tokens": 8}
    r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    hi = [{"role": "user", "content": "Hi"}]
    ids = httpx.post(f"{url}/tokenize", json={"messages": hi}).json()
    text = httpx.post(f"{url}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text == "user\nHi\nassistant\n"  # (special tokens are not shown)


def test_a_client_disconnect_logs_one_line(server: tuple[str, Path, int]) -> None:
    url, log, _ = server
    before = log.read_text()
    # (long enough to outlast the 0.5 s timeout and the server's 0.1 s watch on any machine:
    # at 200 tokens a fast one finished first, sent its answer to nobody and logged nothing)
    body = {"prompt": "Tell me a long story", "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 10
    while "the client disconnected" not in log.read_text()[len(before) :]:
        assert time.monotonic() < deadline, log.read_text()[len(before) :]
        time.sleep(0.1)
    new = log.read_text()[len(before) :]
    assert new.count("the client disconnected") == 1
    assert "Traceback" not in log.read_text()


def _raw(url: str, head: bytes, pause: float = 0.0) -> bytes:
    """What the server answers a raw request ``head`` sent in 64 KiB writes (``pause`` seconds
    apart), read until it closes the connection or 30 s pass."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        try:
            for i in range(0, len(head), 1 << 16):
                s.sendall(head[i : i + (1 << 16)])
                time.sleep(pause)
        except (BrokenPipeError, ConnectionResetError):
            pass  # (closed on us mid-send: its answer is read below)
        out = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
    return out


def test_a_huge_request_head_gets_a_400_and_is_not_buffered(server: tuple[str, Path, int]) -> None:
    """A request line or headers past 16 KiB (one header of 8 MB, sent in one go or slowly;
    many small headers; a long URL) get a 400 naming the limit and a closed connection, as
    uvicorn's h11 protocol answered them, while the server's memory stays put (its C parser
    would buffer them all); heads within the limit are served."""
    url, _, pid = server

    def rss() -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1])

    before = rss()
    heads = [
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8_000_000 + b"\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: bbbbbbbbbbbbbbbb\r\n" * 2000 + b"\r\n",
        b"GET /health?" + b"q" * 40_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    ]
    for head in heads:
        got = _raw(url, head)
        assert got.startswith(b"HTTP/1.1 400"), got[:200]
        assert b"over 16384 bytes" in got, got[-200:]
    got = _raw(url, heads[0][:300_000], pause=0.01)  # (slowly, never finished)
    assert got.startswith(b"HTTP/1.1 400"), got[:200]
    assert rss() - before < 20_000, (before, rss())  # KiB
    ok = _raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Ok: " + b"c" * 12_000 + b"\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 200"), ok[:200]
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_sigterm_under_64_streams_ends_every_stream(tmp_path: Path) -> None:
    """SIGTERM: new requests get 503 with Retry-After while the 64 streams run on for the grace
    period; then each ends with finish reason "abort" and [DONE], and the process exits within
    grace + 5 s."""
    smollm2_path()
    grace = 2.0
    with run_server(tmp_path, "--shutdown-grace", str(grace)) as (url, proc):
        first = threading.Barrier(65)

        def stream(i: int) -> tuple[str | None, bool]:
            body = {"prompt": f"Story {i}:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            reason, done, seen = None, False, False
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        if not seen:
                            seen = True
                            first.wait(60)
                        reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
            return reason, done

        with ThreadPoolExecutor(64) as pool:
            results = [pool.submit(stream, i) for i in range(64)]
            first.wait(120)  # every stream has its first token
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=5)
            check_error(refused, 503, "shutting down")
            assert refused.headers["retry-after"]
            assert httpx.get(f"{url}/health").status_code == 503
            ends = [r.result() for r in results]
        proc.wait(grace + 10)
        took = time.monotonic() - t0
    assert ends == [("abort", True)] * 64
    assert proc.returncode == 0 and took <= grace + 5, took
