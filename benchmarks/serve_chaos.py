"""Chaos load test of `inferflow serve` over loopback (issue 24): C streaming clients for D
seconds, a share of them closing their stream mid-way, plus one attacker cycling through the
hostile requests of inferflow.server.attacks (and a 4 MB /tokenize) against a server whose chat
template is hostile too. Meanwhile /health is polled from its own thread.

    python benchmarks/serve_chaos.py [--clients 64] [--duration 60] [--kill-fraction 0.3]

Prints served / disconnected / refused / failed counts, what the attacker got, the KV-cache
usage once the load is over (must be 0) and the slowest /health answer. Exits 1 on any 5xx, a
lost, cut or garbled response, an attack answered otherwise than its entry says, KV blocks left
in use, or a /health answer slower than --health-limit seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from inferflow.server.attacks import ATTACKS, Health, hostile_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import Load, run, settle, start_server  # noqa: E402

BIG = "word " * 800_000  # a 4 MB /tokenize: legitimate, heavy


@dataclass
class Attacker:
    sent: int = 0
    expected: int = 0
    unexpected: dict[str, str] = field(default_factory=dict)  # attack -> what it got
    slowest: dict[str, float] = field(default_factory=dict)


async def attack(url: str, until: float, a: Attacker) -> None:
    """Every attack in turn (and the big /tokenize) until ``until``."""
    async with httpx.AsyncClient(timeout=60) as c:
        while time.perf_counter() < until:
            for name, x in [*ATTACKS.items(), ("4 MB /tokenize", None)]:
                if time.perf_counter() >= until:
                    return
                t0 = time.perf_counter()
                try:
                    if x is None:
                        r = await c.post(f"{url}/tokenize", json={"prompt": BIG})
                        ok = r.status_code == 200 and r.json()["count"] >= 800_000
                    else:
                        if isinstance(x.body, str):
                            headers = {"content-type": "application/json"}
                            r = await c.post(f"{url}{x.route}", content=x.body, headers=headers)
                        else:
                            r = await c.post(f"{url}{x.route}", json=x.body)
                        message = r.json().get("error", {}).get("message", "")
                        ok = r.status_code == x.status and all(w in message for w in x.words)
                    got = f"HTTP {r.status_code}: {r.text[:160]}"
                except httpx.HTTPError as e:
                    ok, got = False, type(e).__name__
                took = time.perf_counter() - t0
                a.sent += 1
                a.slowest[name] = max(a.slowest.get(name, 0.0), took)
                if ok:
                    a.expected += 1
                else:
                    a.unexpected[name] = got
                await asyncio.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--kill-fraction", type=float, default=0.3)
    ap.add_argument("--prompt-words", default="8-120", help="prompt length range, words")
    ap.add_argument("--max-tokens", default="8-96", help="max_tokens range")
    ap.add_argument("--health-limit", type=float, default=1.0, help="seconds (1)")
    ap.add_argument("--server-args", default="", help="extra `inferflow serve` flags")
    args = ap.parse_args()
    span = lambda s: tuple(int(x) for x in s.split("-"))  # noqa: E731
    load = Load(span(args.prompt_words), span(args.max_tokens), args.kill_fraction)
    server_args = ["--template-timeout", "1", *shlex.split(args.server_args)]
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "hostile.yaml"
        spec.write_text("name: hostile\nbase: smollm2-135m-instruct\n" + hostile_tokenizer())
        proc, url, _ = start_server(str(spec), server_args)
        health = Health(url)
        attacker = Attacker()
        try:
            load.max_model_len = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]

            async def chaos() -> tuple:
                until = time.perf_counter() + args.duration
                return await asyncio.gather(
                    run(url, args.clients, args.duration, 0, load), attack(url, until, attacker)
                )

            with health:
                (t, wall), _ = asyncio.run(chaos())
            after = settle(url)
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(
        f"{args.clients} streaming clients for {args.duration:.0f}s, {args.kill_fraction:.0%} of "
        f"the admitted streams closed mid-way, one attacker ({len(ATTACKS)} attacks + a 4 MB "
        "/tokenize, in turn)"
    )
    rows = [
        ("served in full", t.ok),
        ("disconnected", t.killed),
        ("refused (429)", t.refused),
        ("failed (5xx, errors)", t.failed),
        ("cut short", t.truncated),
        ("garbled", t.garbled),
        ("lost", t.sent - t.ended),
        ("attacks sent", attacker.sent),
        ("attacks as expected", attacker.expected),
    ]
    for label, value in rows:
        print(f"{label:<24} {value:8d}")
    print(f"{'generated tokens/s':<24} {t.tokens / wall:8.1f}")
    usage = after.get("inferflow_kv_cache_usage_ratio", float("nan"))
    print(f"{'KV-cache usage after':<24} {usage:8.3f}")
    print(f"{'slowest /health':<24} {health.worst:8.3f} s  ({health.polls} polls)")
    slow = sorted(attacker.slowest.items(), key=lambda kv: -kv[1])[:4]
    print(f"{'slowest attacks':<24} " + ", ".join(f"{k} {v:.2f}s" for k, v in slow))
    if t.errors:
        print(f"{'client failures':<24} {t.errors}")
    if attacker.unexpected:
        print(f"{'unexpected answers':<24} {attacker.unexpected}")
    bad = (
        t.failed
        or t.truncated
        or t.garbled
        or t.sent != t.ended
        or attacker.unexpected
        or usage != 0
        or health.failures
        or health.worst > args.health_limit
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
