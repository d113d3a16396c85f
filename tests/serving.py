"""Helpers for tests that run `inferflow serve` as a real process on a free localhost port
(tests/test_server.py, tests/test_server_fuzz.py, tests/test_server_load.py)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import torch

from inferflow.parallel import free_port
from tests.conftest import smollm2_path

NAME = "smollm2-embed"  # the default model, declared for /v1/embeddings too


@contextlib.contextmanager
def run_server(
    tmp: Path, *args: str, spec_extra: str = "", spec: str | None = None, verbose: bool = False
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Serve ``spec`` (a built-in name or a path; default: the default model as NAME, with
    mean-pooled embeddings, plus ``spec_extra`` YAML lines) with the extra CLI ``args``; yields
    (base URL, process) once /health says ok and stops the process (SIGINT, then kill) at the
    end. ``verbose``: the log (``server-PORT.log`` in ``tmp``) has INFO lines too."""
    if spec is None:
        path = tmp / "embed.yaml"
        path.write_text(
            f"name: {NAME}\nbase: smollm2-135m-instruct\nembeddings: {{pooling: mean}}\n"
            + spec_extra
        )
        spec = str(path)
    port = free_port()
    log_path = tmp / f"server-{port}.log"
    log = open(log_path, "w")  # noqa: SIM115
    cmd = [sys.executable, "-m", "inferflow.cli.main", *(["-v"] if verbose else []), "serve"]
    cmd += [spec, "--port", str(port)]
    proc = subprocess.Popen([*cmd, *args], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


def check_error(r: httpx.Response, status: int, *needles: str) -> None:
    """``r`` has ``status`` and OpenAI's error body, whose message contains every needle."""
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["message"] and body["type"]
    for n in needles:
        assert n in body["message"], body


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """One sample of the server's Prometheus text (``name`` with its labels, if any)."""
    for ln in httpx.get(f"{url}/metrics", headers=headers).text.splitlines():
        if ln.startswith((name + " ", name + "{")):
            return float(ln.split()[-1])
    raise AssertionError(name)


def wait_for(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def smollm2_transformers() -> tuple[Any, Any]:
    """The default model's GGUF in transformers, float32: (model, tokenizer), the reference of
    the servers that serve it with ``--quant none``."""
    import transformers as tf

    path = smollm2_path()
    model = tf.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


def greedy(hf: tuple[Any, Any], ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` (at most ``n`` tokens; it stops at EOS)."""
    model, _ = hf
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, top_p=None, top_k=None
        )
    return list(out[0, len(ids) :].tolist())
