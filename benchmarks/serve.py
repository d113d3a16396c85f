"""Serving throughput like for like: `inferflow serve` and llama.cpp's `llama-server -np N -cb` on
the same GGUF with the same threads, each driven over HTTP by one load client in its own
process (streaming, the OpenAI wire format: /v1/completions with token-id prompts, greedy,
``ignore_eos``; a connection per request, HTTP/1.1 written and read by the client itself, so
its own work stays small), distinct prompts every round, no prompt cache on either side.

    python benchmarks/serve.py [--specs A,B,C] [--concurrency 1,8,32] [--rounds 3]
                               [--llama-server PATH] [--prompt-len 64] [--output-len 128]
                               [--threads 2] [--dtypes auto,float32]

For each file (``--specs``; default: SmolLM2-135M Q4_1, Qwen2.5-Coder-0.5B Q4_K_M and
Qwen2.5-Coder-1.5B Q4_K_M, the last skipped where ``tools/fetch_models.py qwen2.5-coder-1.5b``
has not assembled it) each server starts once (llama-server with as many slots as the largest N;
one Inferflow server per ``--dtypes`` value, ``auto`` being serve's default); then every round
runs every N on each server in turn. Reported per N and server: generated tokens/s (all tokens
over the wall clock from the first request sent to the last token received), mean / p50 / p99
time to first token and inter-token latency, the median over rounds, and the median of the
rounds' own ratios; per file, the bytes of weights a one-sequence step reads and the floor that
puts on its inter-token time at the machine's read bandwidth (measured first). The
llama-server binary: ``--llama-server``, else on PATH, else the one
``python tools/build_llama_cpp.py --server`` built; without one only Inferflow's rows print.
benchmarks/throughput.py times the in-process engine (no HTTP).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from inferflow.parallel import free_port  # noqa: E402  (no torch: this process stays light)

# the benchmark's files: the default model, the most common kind of Hub file (Q4_K_M: Q5_0 /
# Q6_K / Q8_0 / Q4_K), and a larger one (an opt-in fetch: skipped where absent)
SPECS = (
    "smollm2-135m-instruct",
    "qwen2.5-coder-0.5b-instruct",
    "qwen2.5-coder-1.5b-instruct",
)
VOCAB_LOW, VOCAB_HIGH = 1000, 40000  # prompt token ids drawn from plain text ids


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


# --- the load client (run in its own process: --client) -------------------------------------


async def _post_stream(url: str, payload: dict) -> AsyncIterator[bytes]:
    """The body of a POST's response as it arrives, over a connection of its own: HTTP/1.1
    written and read by hand (chunked or not), no client library in between. The client
    shares the machine's cores with the server it measures, so its own work stays small (the
    httpx client this replaced: the first of 32 requests reached the server 27-33 ms after the
    round's clock started, against 3-5 ms now, and 0.47-0.52 s of user CPU a round of 32
    streams, against 0.19-0.23 s; issue 44's notes)."""
    host, _, port = url.removeprefix("http://").partition(":")
    body = json.dumps(payload).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        status = (await reader.readline()).split(b" ", 2)
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        code = status[1].decode("latin-1") if len(status) > 1 else "(no status line)"
        if code != "200":
            raise RuntimeError(f"HTTP {code}: {(await reader.read(200))!r}")
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await reader.readline()).split(b";")[0], 16):
                yield (await reader.readexactly(size + 2))[:-2]
        elif "content-length" in headers:
            yield await reader.readexactly(int(headers["content-length"]))
        else:
            while data := await reader.read(65536):
                yield data
    finally:
        writer.close()


async def _one(url: str, body: dict, t0: float, out: dict) -> None:
    stamps: list[float] = []
    pending = b""
    async for data in _post_stream(url, body):
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            if not line.startswith(b"data: ") or line.rstrip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                stamps.append(time.perf_counter() - t0)
    out["stamps"] = stamps


async def _load(url: str, n: int, prompt_len: int, out_len: int, seed: int, llama: bool) -> dict:
    rng = random.Random(seed)
    bodies = [
        {
            "prompt": [rng.randint(VOCAB_LOW, VOCAB_HIGH) for _ in range(prompt_len)],
            "max_tokens": out_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        for _ in range(n)
    ]
    if llama:  # its prompt cache off (Inferflow's prefix cache finds nothing: distinct prompts)
        for b in bodies:
            b["cache_prompt"] = False
    results: list[dict] = [{} for _ in bodies]
    t0 = time.perf_counter()
    await asyncio.gather(*(_one(url, b, t0, r) for b, r in zip(bodies, results, strict=True)))
    wall = time.perf_counter() - t0
    stamps = [r["stamps"] for r in results]
    if any(len(s) == 0 for s in stamps):
        raise RuntimeError("a request streamed no text")
    return {
        "tokens": sum(len(s) for s in stamps),
        "wall": wall,
        "ttft": [s[0] for s in stamps],
        "itl": [b - a for s in stamps for a, b in zip(s, s[1:], strict=False)],
    }


def client_main(args: argparse.Namespace) -> int:
    res = asyncio.run(
        _load(args.client, args.n, args.prompt_len, args.output_len, args.seed, args.llama)
    )
    print(json.dumps(res))
    return 0


# --- the servers ----------------------------------------------------------------------------


def _wait_ready(url: str, proc: subprocess.Popen, what: str, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise SystemExit(f"{what} was not ready after {timeout:.0f} s")


@contextlib.contextmanager
def _server(cmd: list[str], port: int, what: str) -> Iterator[str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, what)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _run_client(url: str, n: int, args: argparse.Namespace, seed: int, llama: bool) -> dict:
    cmd = [sys.executable, __file__, "--client", url, "--n", str(n), "--seed", str(seed)]
    cmd += ["--llama"] if llama else []
    cmd += ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"load client failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def find_binary(given: str | None) -> Path | None:
    """The llama-server to use: ``given`` (a path), else ``llama-server`` on PATH, else the
    build of ``tools/build_llama_cpp.py --server``, else None."""
    if given:
        if not Path(given).is_file():
            raise SystemExit(f"--llama-server: {given} is not a file")
        return Path(given)
    found = shutil.which("llama-server")
    return Path(found) if found else _cached_server()


def _cached_server() -> Path | None:
    """tools/build_llama_cpp.py --server's build, where one was made."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from build_llama_cpp import CACHE

    path = CACHE / "server-bin" / "llama-server"
    return path if os.access(path, os.X_OK) else None


def _gguf_of(spec: str) -> Path:
    from inferflow.spec import load_spec  # (the parent process only)

    return Path(load_spec(spec).source.files[0]).expanduser()


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def read_bandwidth(threads: int) -> float:
    """Bytes per second the machine reads with ``threads`` threads: the best of five sums of a
    1 GiB float32 tensor, in a child process (this one does not import torch)."""
    code = (
        "import time, torch\n"
        f"torch.set_num_threads({threads})\n"
        "a = torch.ones(1 << 28)\n"
        "best = 1e9\n"
        "for _ in range(5):\n"
        "    t = time.perf_counter(); a.sum().item(); best = min(best, time.perf_counter() - t)\n"
        "print(a.nbytes / best)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout.strip())


def weight_bytes_per_token(gguf: Path) -> int:
    """Bytes of the file's tensors a one-sequence decode step reads: all but the token
    embedding (one row of it is looked up), which a tied head reads whole."""
    from gguf import GGUFReader

    r = GGUFReader(str(gguf))
    sizes = {t.name: int(t.n_bytes) for t in r.tensors}
    tied = "output.weight" not in sizes
    return sum(n for name, n in sizes.items() if tied or name != "token_embd.weight")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--specs", default=",".join(SPECS), help="comma-separated spec names")
    ap.add_argument("--llama-server", default=None, metavar="PATH")
    ap.add_argument(
        "--dtypes", default="auto", help="inferflow serve --dtype values: one server each"
    )
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)  # internal: load client
    ap.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--llama", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        return client_main(args)
    ns = [int(x) for x in args.concurrency.split(",")]
    binary = find_binary(args.llama_server)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inferflow serve's torch threads
    bandwidth = read_bandwidth(args.threads)
    print("command: python benchmarks/serve.py " + shlex.join(sys.argv[1:]))
    print(
        f"{cpu_name()}, {os.cpu_count()} CPUs; threads={args.threads}; read bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (the best sum of 1 GiB); prompts {args.prompt_len} tokens "
        f"(distinct each round), {args.output_len} generated each; {args.rounds} round(s): "
        "medians over rounds"
    )
    for spec in args.specs.split(","):
        gguf = _gguf_of(spec)
        if not gguf.exists():
            print(f"\n{spec}: skipped, {gguf} is absent (see tools/fetch_models.py)")
            continue
        names, results = _run_spec(spec, gguf, ns, args, binary)
        _report(args, ns, names, results, gguf, bandwidth)
    return 0


def _run_spec(
    spec: str, gguf: Path, ns: list[int], args: argparse.Namespace, binary: Path | None
) -> tuple[list[str], dict[tuple[str, int], list[dict]]]:
    """Every N on each server (ours per dtype, llama-server), ``args.rounds`` times."""
    servers: list[tuple[str, list[str], int]] = []
    for dtype in args.dtypes.split(","):
        p1 = free_port()
        ours = [sys.executable, "-m", "inferflow.cli.main", "serve", spec, "--port", str(p1)]
        name = "inferflow serve" if dtype == "auto" else f"inferflow {dtype}"
        servers.append((name, [*ours, "--dtype", dtype], p1))
    if binary is not None:
        p2 = free_port()
        ctx = max(ns) * (args.prompt_len + args.output_len + 16)  # -c is shared by the slots
        llama = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(p2)]
        llama += ["-np", str(max(ns)), "-cb", "-c", str(ctx), "-t", str(args.threads)]
        llama += ["-tb", str(args.threads), "-b", "512", "--no-webui"]
        servers.append(("llama-server -cb", llama, p2))
    results: dict[tuple[str, int], list[dict]] = {}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(_server(cmd, port, name)) for name, cmd, port in servers}
        for name, url in urls.items():  # warm-up: kernels built, first allocations made
            _run_client(url, 2, args, seed=10**6, llama=name.startswith("llama"))
        for r in range(args.rounds):
            for n in ns:
                for name, url in urls.items():
                    seed = 1000 * r + n  # distinct prompts every round, the same for both
                    got = _run_client(url, n, args, seed, llama=name.startswith("llama"))
                    results.setdefault((name, n), []).append(got)
    return [name for name, _, _ in servers], results


def _report(
    args: argparse.Namespace,
    ns: list[int],
    names: list[str],
    results: dict[tuple[str, int], list[dict]],
    gguf: Path,
    bandwidth: float,
) -> None:
    per_token = weight_bytes_per_token(gguf)
    print(
        f"\n{gguf.name}: {gguf.stat().st_size / 1e6:.0f} MB; a one-sequence step reads "
        f"{per_token / 1e6:.0f} MB of weights: bandwidth floor {per_token / bandwidth * 1e3:.1f} "
        "ms per token at N=1"
    )
    head = f"{'N':>3} {'server':18} {'gen tok/s':>9} {'TTFT mean':>9} {'p50':>7} {'p99':>7}"
    head += f" {'ITL mean':>8} {'p50':>7} {'p99':>7} {'tok/s ratio':>11}"
    print(head)
    for n in ns:
        base = [r["tokens"] / r["wall"] for r in results.get(("llama-server -cb", n), [])]
        for name in names:
            rs = results[(name, n)]
            tps = [r["tokens"] / r["wall"] for r in rs]
            med = statistics.median

            def m(key: str, q: float | None, rs: list[dict] = rs) -> float:
                def f(xs: list[float]) -> float:
                    return statistics.fmean(xs) if q is None else pct(xs, q)

                return statistics.median(f(r[key]) for r in rs)

            ratio = f"{med(a / b for a, b in zip(tps, base, strict=True)):.2f}x" if base else "-"
            print(
                f"{n:>3} {name:18} {med(tps):9.1f} {m('ttft', None):8.2f}s "
                f"{m('ttft', 0.5):6.2f}s {m('ttft', 0.99):6.2f}s {m('itl', None) * 1e3:6.1f}ms "
                f"{m('itl', 0.5) * 1e3:5.1f}ms {m('itl', 0.99) * 1e3:5.1f}ms {ratio:>11}"
            )
            print(f"{'':22}rounds: " + ", ".join(f"{t:.1f}" for t in tps))


if __name__ == "__main__":
    sys.exit(main())
