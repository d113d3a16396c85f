"""llama.cpp's HTTP server as a throughput peer: start ``llama-server`` on a GGUF with N parallel
slots and continuous batching (``-np N -cb``), send N streaming /completion requests at once
(token-id prompts, greedy, a fixed number of tokens each), and measure what a client sees.

Used by benchmarks/throughput.py (``--llama-server PATH``); the binary is not part of the
project: build it from llama.cpp's sources (``cmake --build build --target llama-server``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx

from inferflow.parallel import free_port


def find_binary(given: str | None) -> Path | None:
    """The llama-server to use: ``given`` (a path), else ``llama-server`` on PATH, else None."""
    if given:
        p = Path(given)
        if not p.is_file():
            raise SystemExit(f"--llama-server: {given} is not a file")
        return p
    found = shutil.which("llama-server")
    return Path(found) if found else None


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"llama-server was not ready after {timeout:.0f} s")


def _stream_one(url: str, prompt: list[int], out_len: int, t0: float, result: dict) -> None:
    body = {
        "prompt": prompt,
        "n_predict": out_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "cache_prompt": False,
        "stream": True,
    }
    stamps: list[float] = []
    n_tok = 0
    with httpx.stream("POST", f"{url}/completion", json=body, timeout=None) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("stop"):
                n_tok = int(chunk.get("tokens_predicted", len(stamps)))
                break
            stamps.append(time.perf_counter() - t0)
    result.update(stamps=stamps, tokens=n_tok)


def run_llama_server(
    binary: Path, gguf: Path, prompts: list[list[int]], out_lens: list[int], threads: int
) -> dict:
    """tok/s, TTFT and inter-token gaps of N concurrent requests, as benchmarks/throughput.py's
    ``run_inferflow`` reports them (the server is started and stopped here, its start-up not
    counted)."""
    n = len(prompts)
    ctx = n * (max(map(len, prompts)) + max(out_lens) + 16)  # -c is shared by the -np slots
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", str(n), "-cb", "-c", str(ctx), "-t", str(threads), "-tb", str(threads)]
    cmd += ["-b", "512", "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc)
        _stream_one(url, prompts[0][:8], 2, time.perf_counter(), {})  # warm-up
        results: list[dict] = [{} for _ in prompts]
        t0 = time.perf_counter()
        workers = [
            threading.Thread(target=_stream_one, args=(url, p, k, t0, r))
            for p, k, r in zip(prompts, out_lens, results, strict=True)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if any("stamps" not in r or not r["stamps"] for r in results):
        raise RuntimeError("a llama-server request returned no tokens")
    gaps = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
    return dict(
        tps=sum(r["tokens"] for r in results) / wall,
        ttft=[r["stamps"][0] for r in results],
        itl=gaps,
        wall=wall,
    )
