"""Start-up: seconds from starting ``inferflow serve SPEC`` to the first streamed token of a chat
completion, in fresh processes.

    python benchmarks/startup.py [--spec smollm2-135m-instruct] [--rounds 5] [--port 8931]

Per round the clock starts just before the server process is spawned; the client polls
``/health`` every 5 ms until it answers 200, then sends one streaming chat request (greedy, 8
tokens) and stops the clock at the first chunk carrying text. Columns: health 200 (the model
loaded and serving), first token, and the server's own ``loaded in … s`` line. Two cases:

- ``warm``: C kernels already built (the user's kernel cache) and the files in the page cache
  (one untimed round first);
- ``first run``: an empty kernel cache (``INFERFLOW_KERNEL_CACHE`` pointed at a new folder), so
  every C kernel the server uses is compiled during start-up, as on a fresh machine.

Medians over ``--rounds`` rounds each.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.005


def _health(port: int) -> int | None:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        conn.close()
        return status
    except OSError:
        return None


def _first_token(port: int) -> None:
    body = {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"chat request: HTTP {resp.status}: {resp.read()[:200]!r}")
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        delta = json.loads(line[6:])["choices"][0].get("delta", {})
        if delta.get("content"):
            conn.close()
            return
    raise RuntimeError("the stream ended without a token")


def one_round(spec: str, port: int, env: dict[str, str]) -> tuple[float, float, float | None]:
    """(seconds to /health 200, seconds to the first token, the server's own load seconds)."""
    cmd = [sys.executable, "-m", "inferflow.cli.main", "serve", spec, "--port", str(port)]
    with tempfile.TemporaryFile(mode="w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while _health(port) != 200:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"server exited ({proc.returncode}): {log.read()[-2000:]}")
                if time.perf_counter() - t0 > 300:
                    raise RuntimeError("server not ready after 300 s")
                time.sleep(POLL_S)
            ready = time.perf_counter() - t0
            _first_token(port)
            first = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        log.seek(0)
        m = re.search(r"loaded in ([0-9.]+) s", log.read())
    return ready, first, float(m.group(1)) if m else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--spec", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--port", type=int, default=8931)
    args = ap.parse_args()
    print("command: python " + shlex.join(["benchmarks/startup.py", *sys.argv[1:]]))
    print(f"{args.spec}; medians of {args.rounds} fresh server processes; seconds\n")
    print("| case | health 200 | first token | server's load |")
    print("|---|---:|---:|---:|")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    one_round(args.spec, args.port, env)  # untimed: kernels built, files in the page cache
    cases: list[tuple[str, bool]] = [("warm", False), ("first run", True)]
    for name, fresh in cases:
        runs = []
        for _ in range(args.rounds):
            run_env = dict(env)
            if fresh:
                run_env["INFERFLOW_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="inferflow-kernels-")
            runs.append(one_round(args.spec, args.port, run_env))
        ready, first = (statistics.median(r[i] for r in runs) for i in (0, 1))
        loads = [r[2] for r in runs if r[2] is not None]
        load = f"{statistics.median(loads):.2f}" if loads else "-"
        print(f"| {name} | {ready:.2f} | {first:.2f} | {load} |", flush=True)


if __name__ == "__main__":
    main()
