"""Load test of `inferflow serve` over loopback: C concurrent streaming clients for D seconds,
random prompt / output lengths; prints requests/s, tokens/s, TTFT and ITL percentiles, and the
count of failed, truncated or garbled responses (a 429 is counted apart: admission control).

    python benchmarks/serve_load.py [--clients 64] [--duration 60] [--url URL | --spec SPEC]

Without --url it starts the server itself (on a free port, the default model) and stops it at
the end; it also measures start-to-first-token: process start until the first streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time

import httpx

WORDS = "the sea river mountain light storm ship keeper lamp night wind stone bird road".split()


# (not imported from throughput.py: that pulls in torch, and this client must stay light so it
# does not take CPU from the server it measures, start-up included)
def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Tally:
    def __init__(self) -> None:
        self.ok = self.failed = self.truncated = self.garbled = self.refused = 0
        self.tokens = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []


async def one(client: httpx.AsyncClient, url: str, rng: random.Random, t: Tally) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 200)))
    want = rng.randint(8, 128)
    body = {
        "prompt": prompt,
        "max_tokens": want,
        "temperature": 0.8,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    last = None
    got, done, text = 0, False, ""
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code == 429:  # a well-behaved client waits as Retry-After says
                t.refused += 1
                await r.aread()
                await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                return
            if r.status_code != 200:
                t.failed += 1
                return
            async for line in r.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    t.garbled += 1
                    return
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    t.failed += 1
                    return
                now = time.perf_counter()
                if chunk["choices"][0]["text"]:
                    got += 1
                    text += chunk["choices"][0]["text"]
                    if last is None:
                        t.ttft.append(now - t0)
                    else:
                        t.itl.append(now - last)
                    last = now
                reason = chunk["choices"][0]["finish_reason"]
                if reason and reason != "length":
                    t.failed += 1
                    return
    except (httpx.HTTPError, json.JSONDecodeError):
        t.failed += 1
        return
    if not done:
        t.truncated += 1
    elif not text:
        t.garbled += 1
    else:
        t.ok += 1
        t.tokens += got


async def run(url: str, clients: int, duration: float) -> tuple[Tally, float]:
    t = Tally()
    end = time.perf_counter() + duration
    limits = httpx.Limits(max_connections=clients + 4)

    async def worker(i: int) -> None:
        rng = random.Random(i)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            while time.perf_counter() < end:
                await one(c, url, rng, t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(clients)))
    return t, time.perf_counter() - t0


def start_server(spec: str | None, extra: list[str]) -> tuple[subprocess.Popen, str, float]:
    """Start `inferflow serve` and time process start -> first streamed token."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "inferflow.cli.main",
        "serve",
        *([spec] if spec else []),
        "--port",
        str(port),
        *extra,
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        try:
            with httpx.stream(
                "POST",
                f"{url}/v1/completions",
                json={"prompt": "Hello", "max_tokens": 2, "stream": True},
                timeout=5,
            ) as r:
                if r.status_code == 200:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            return proc, url, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--spec", default=None)
    ap.add_argument("--server-args", default="", help="extra `inferflow serve` flags")
    args = ap.parse_args()
    proc, startup = None, float("nan")
    url = args.url
    if url is None:
        proc, url, startup = start_server(args.spec, shlex.split(args.server_args))
    try:
        t, wall = asyncio.run(run(url, args.clients, args.duration))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(
        f"{args.clients} streaming clients for {args.duration:.0f}s; prompts 8-200 words, 8-128 tokens each"
    )
    print(f"{'start->first token':<22} {startup:8.2f} s")
    print(f"{'requests ok':<22} {t.ok:8d}   ({t.ok / wall:.2f} req/s)")
    print(f"{'generated tokens/s':<22} {t.tokens / wall:8.1f}")
    print(
        f"{'TTFT p50 / p99':<22} {pct(t.ttft, 0.5):8.3f} / {pct(t.ttft, 0.99):.3f} s (mean {statistics.mean(t.ttft) if t.ttft else float('nan'):.3f})"
    )
    print(f"{'ITL p50 / p99':<22} {1000 * pct(t.itl, 0.5):8.1f} / {1000 * pct(t.itl, 0.99):.1f} ms")
    print(f"{'failed':<22} {t.failed:8d}")
    print(f"{'truncated':<22} {t.truncated:8d}")
    print(f"{'garbled':<22} {t.garbled:8d}")
    print(f"{'refused (429)':<22} {t.refused:8d}")
    return 1 if t.failed or t.truncated or t.garbled else 0


if __name__ == "__main__":
    sys.exit(main())
