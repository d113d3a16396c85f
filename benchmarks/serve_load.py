"""Load test of `inferflow serve` over loopback: C concurrent streaming clients for D seconds,
random prompt / output lengths; prints requests/s, tokens/s, TTFT and ITL percentiles, and the
count of failed, truncated or garbled responses (a 429 is counted apart: admission control).

    python benchmarks/serve_load.py [--clients 64] [--duration 60] [--url URL | --spec SPEC]

Without --url it starts the server itself (on a free port, the default model) and stops it at
the end; it also measures start-to-first-token: process start until the first streamed token.

Resource limits (``--limits``, needs the server started here): the server's resident memory is
sampled during the run and checked against a bound computed from the spec and the serve flags
(inferflow.server.memory: weights + KV budget + activations + runtime), and after the run every
KV block must be free again. With ``--requests-per-client 1`` every client sends one request
and a 429 is final; ``--kill-fraction`` of the admitted streams are closed by their client
mid-way (the first one and then every 1/fraction-th, so the share is exact):

    python benchmarks/serve_load.py --limits --clients 128 --requests-per-client 1 \\
        --prompt-words 100-250 --max-tokens 32-96 --kill-fraction 0.25 \\
        --server-args "--kv-cache-memory 32MiB --max-waiting 16"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from inferflow.parallel import free_port  # no torch: the client stays light

WORDS = "the sea river mountain light storm ship keeper lamp night wind stone bird road".split()


# (not imported from throughput.py: that pulls in torch, and this client must stay light so it
# does not take CPU from the server it measures, start-up included)
def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


@dataclass
class Load:
    """What each request looks like (from the command line)."""

    words: tuple[int, int] = (8, 200)
    tokens: tuple[int, int] = (8, 128)
    kill: float = 0.0  # fraction of admitted streams that the client closes mid-way
    max_model_len: int = 0  # the server's (context or KV capacity): a legitimate "length" end


@dataclass
class Tally:
    ok: int = 0
    failed: int = 0
    truncated: int = 0
    garbled: int = 0
    refused: int = 0
    killed: int = 0
    sent: int = 0
    admitted: int = 0  # streams that got a 200 (the kill fraction counts these)
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # what the failed ones got

    def fail(self, why: str) -> None:
        self.failed += 1
        self.errors[why] = self.errors.get(why, 0) + 1

    @property
    def ended(self) -> int:  # requests with an outcome; sent - ended were lost
        return self.ok + self.failed + self.truncated + self.garbled + self.refused + self.killed


async def one(
    client: httpx.AsyncClient, url: str, rng: random.Random, t: Tally, load: Load
) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*load.words)))
    want = rng.randint(*load.tokens)
    kill_after = rng.randint(1, max(1, want - 1))
    body = {
        "prompt": prompt,
        "max_tokens": want,
        "temperature": 0.8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    t.sent += 1
    t0 = time.perf_counter()
    last = None
    got, done, text, reason, usage = 0, False, "", None, None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code == 429:  # a well-behaved client waits as Retry-After says
                t.refused += 1
                await r.aread()
                await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                return
            if r.status_code != 200:
                t.fail(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            # the first admitted stream and then every 1/kill-th is closed mid-way: a fixed
            # share of what the server took on, however many the admission limit refused
            n, t.admitted = t.admitted, t.admitted + 1
            if math.ceil((n + 1) * load.kill) == math.ceil(n * load.kill):
                kill_after = None
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
                    t.fail(f"error event: {chunk['error'].get('message')}")
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if not chunk["choices"]:
                    continue
                now = time.perf_counter()
                if chunk["choices"][0]["text"]:
                    got += 1
                    text += chunk["choices"][0]["text"]
                    if last is None:
                        t.ttft.append(now - t0)
                    else:
                        t.itl.append(now - last)
                    last = now
                reason = chunk["choices"][0]["finish_reason"] or reason
                if kill_after is not None and got >= kill_after and reason is None:
                    t.killed += 1  # leaving the block closes the connection mid-stream
                    return
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        t.fail(type(e).__name__)
        return
    t.reasons[str(reason)] = t.reasons.get(str(reason), 0) + 1
    if not done or usage is None or reason not in ("length", "stop"):
        t.truncated += 1
    elif not text:
        t.garbled += 1
    elif (
        reason == "length"
        and usage["completion_tokens"] != want
        and (usage["prompt_tokens"] + usage["completion_tokens"] != load.max_model_len)
    ):  # "length" before max_tokens is only right at the end of the context
        t.truncated += 1
    else:
        t.ok += 1
        t.tokens += got


async def run(
    url: str, clients: int, duration: float, per_client: int, load: Load
) -> tuple[Tally, float]:
    t = Tally()
    end = time.perf_counter() + duration
    limits = httpx.Limits(max_connections=clients + 4)

    async def worker(i: int) -> None:
        rng = random.Random(i)
        async with httpx.AsyncClient(timeout=300, limits=limits) as c:
            n = 0
            while (n < per_client) if per_client else (time.perf_counter() < end):
                await one(c, url, rng, t, load)
                n += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(clients)))
    return t, time.perf_counter() - t0


def start_server(
    spec: str | None, extra: list[str], log: str | None = None
) -> tuple[subprocess.Popen, str, float]:
    """Start `inferflow serve` (its output to the file ``log``, else discarded) and time process
    start -> first streamed token."""
    port = free_port()
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
    if log:
        with open(log, "w") as sink:  # (the child keeps its own descriptor)
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    else:
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


async def sample_rss(pid: int, peak: list[int], stop: asyncio.Event) -> None:
    import psutil

    proc = psutil.Process(pid)
    while not stop.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        await asyncio.sleep(0.02)


def gauges(url: str) -> dict[str, float]:
    out = {}
    for ln in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if ln.startswith("inferflow_") and not ln.startswith("#") and "{" not in ln:
            name, value = ln.split()
            out[name] = float(value)
    return out


def settle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """The server's gauges once nothing runs or waits (aborts land within an engine step)."""
    deadline = time.monotonic() + timeout
    while True:
        g = gauges(url)
        idle = not g["inferflow_requests_running"] and not g["inferflow_requests_waiting"]
        if (idle and g["inferflow_kv_cache_usage_ratio"] == 0) or time.monotonic() > deadline:
            return g
        time.sleep(0.1)


def bound_for(spec: str | None, server_args: list[str]):  # noqa: ANN201
    """The memory bound for the server these flags start (parsed by `inferflow serve`'s own
    parser into its own engine settings, so the defaults are the server's)."""
    from inferflow.cli import serve
    from inferflow.model.build import parse_dtype
    from inferflow.server.memory import kv_plan, memory_bound, runtime_rss
    from inferflow.spec import load_spec

    ap = argparse.ArgumentParser()
    serve.add_parser(ap.add_subparsers())
    a = ap.parse_args(["serve", *([spec] if spec else []), *server_args])
    cfg = serve.engine_config(a)
    dtype = parse_dtype(a.dtype)
    s = load_spec(a.spec)
    draft = load_spec(a.draft) if a.draft else None
    bound = memory_bound(s, cfg, runtime_rss(a.spec), dtype, draft)
    return bound, kv_plan(s, cfg, dtype).num_blocks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--requests-per-client", type=int, default=0, help="0: until --duration")
    ap.add_argument("--prompt-words", default="8-200", help="prompt length range, words")
    ap.add_argument("--max-tokens", default="8-128", help="max_tokens range")
    ap.add_argument(
        "--kill-fraction", type=float, default=0.0, help="share of admitted streams closed mid-way"
    )
    ap.add_argument("--limits", action="store_true", help="check RSS bound and KV blocks free")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--spec", default=None)
    ap.add_argument("--server-args", default="", help="extra `inferflow serve` flags")
    ap.add_argument("--server-log", default=None, help="write the server's output to this file")
    args = ap.parse_args()
    if args.limits and args.url:
        ap.error("--limits samples the server process: leave out --url")
    span = lambda s: tuple(int(x) for x in s.split("-"))  # noqa: E731
    load = Load(span(args.prompt_words), span(args.max_tokens), args.kill_fraction)
    proc, startup = None, float("nan")
    url = args.url
    server_args = shlex.split(args.server_args)
    if url is None:
        proc, url, startup = start_server(args.spec, server_args, args.server_log)
    peak, after = [0], {}
    try:
        load.max_model_len = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]

        async def measured() -> tuple[Tally, float]:
            stop = asyncio.Event()
            sampler = asyncio.ensure_future(sample_rss(proc.pid, peak, stop)) if proc else None
            try:
                return await run(url, args.clients, args.duration, args.requests_per_client, load)
            finally:
                stop.set()
                if sampler is not None:
                    await sampler

        t, wall = asyncio.run(measured())
        after = settle(url) if args.limits else {}
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    length = (
        f"{args.requests_per_client} request(s) each"
        if args.requests_per_client
        else (f"for {args.duration:.0f}s")
    )
    print(
        f"{args.clients} streaming clients {length}; prompts {args.prompt_words} words, "
        f"{args.max_tokens} tokens each, {args.kill_fraction:.0%} closed mid-stream"
    )
    print(f"{'start->first token':<22} {startup:8.2f} s")
    print(f"{'requests ok':<22} {t.ok:8d}   ({t.ok / wall:.2f} req/s)")
    print(f"{'generated tokens/s':<22} {t.tokens / wall:8.1f}")
    ttft_mean = statistics.mean(t.ttft) if t.ttft else float("nan")
    print(
        f"{'TTFT p50 / p99':<22} {pct(t.ttft, 0.5):8.3f} / {pct(t.ttft, 0.99):.3f} s "
        f"(mean {ttft_mean:.3f})"
    )
    print(f"{'ITL p50 / p99':<22} {1000 * pct(t.itl, 0.5):8.1f} / {1000 * pct(t.itl, 0.99):.1f} ms")
    for name in ("failed", "truncated", "garbled", "refused", "killed"):
        label = {"refused": "refused (429)", "killed": "closed by client"}.get(name, name)
        print(f"{label:<22} {getattr(t, name):8d}")
    print(f"{'lost':<22} {t.sent - t.ended:8d}   (of {t.sent} sent; finish reasons {t.reasons})")
    if t.errors:
        print(f"{'failures':<22} {t.errors}")
    bad = t.failed or t.truncated or t.garbled or t.sent != t.ended
    result = {"clients": args.clients, "sent": t.sent, "ok": t.ok, "failed": t.failed}
    result |= {"truncated": t.truncated, "garbled": t.garbled, "refused": t.refused}
    result |= {"killed": t.killed, "lost": t.sent - t.ended, "reasons": t.reasons}
    result |= {"errors": t.errors}
    if args.limits:
        bound, blocks = bound_for(args.spec, server_args)
        print(
            f"\nresident memory bound (inferflow.server.memory), max_model_len {load.max_model_len}"
        )
        for name, value in bound.rows():
            print(f"  {name:<20} {value / 2**20:9.1f} MiB")
        print(
            f"{'server RSS peak':<22} {peak[0] / 2**20:8.1f} MiB  (bound {bound.total / 2**20:.1f})"
        )
        free = int(after["inferflow_kv_cache_free_blocks"])
        print(f"{'KV blocks free after':<22} {free:8d} / {blocks}")
        print(f"{'preemptions':<22} {int(after.get('inferflow_preemptions', 0)):8d}")
        bad = bad or peak[0] > bound.total or free != blocks
        result |= {"rss_peak": peak[0], "bound": dict(bound.rows()), "kv_free": free}
        result |= {"kv_blocks": blocks, "gauges_after": after}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
