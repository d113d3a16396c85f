"""Chat templates rendered under a ``TemplateBudget``, in worker processes that can be killed.

A Python thread cannot be interrupted, so a budgeted render runs in one of a few long-lived
worker processes: the worker caps its own address space (``RLIMIT_AS``) for each render, so a
runaway string ends in a ``MemoryError``, and the parent kills it (SIGKILL) past the time limit
and starts a fresh one on the next call. Over the worker's stdin and stdout go length-prefixed
frames: a pickled request, and a tagged UTF-8 reply (the parent never unpickles what a worker
sends).

Workers are plain subprocesses, not multiprocessing's spawn (which re-imports the parent's
``__main__``, the CLI with torch): the bootstrap imports this module without running
``inferflow/tokenizer/__init__.py``, so a worker loads only jinja2 and the chat module.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import pickle
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inferflow.errors import TokenizerError
from inferflow.tokenizer.chat import TemplateBudget, TemplateLimitError, _render

logger = logging.getLogger(__name__)

POOL_SIZE = 2
_START_TIMEOUT_S = 30.0
_HEADER = struct.Struct("!Q")  # byte length of the frame that follows
# reply tags: ready, rendered text, error, limit error
_READY, _TEXT, _ERROR, _LIMIT = b"R", b"T", b"E", b"L"

# Run by the worker's interpreter (argv: sys.path as JSON, this package's directory). A bare
# module registered as inferflow.tokenizer lets its submodules import without its __init__.
_BOOTSTRAP = """\
import json, sys, types
sys.path[:0] = json.loads(sys.argv[1])
package = types.ModuleType("inferflow.tokenizer")
package.__path__ = [sys.argv[2]]
sys.modules["inferflow.tokenizer"] = package
from inferflow.tokenizer.template_worker import serve
serve()
"""


def _frame(body: bytes) -> bytes:
    return _HEADER.pack(len(body)) + body


# -- the worker process --


def serve() -> None:
    """The worker's loop: read a request, render it, write the reply; return at end of input."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which ends us
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print must not corrupt the replies
    replies.write(_frame(_READY))
    replies.flush()
    while len(header := requests.read(_HEADER.size)) == _HEADER.size:
        (size,) = _HEADER.unpack(header)
        tag, text = _handle(pickle.loads(requests.read(size)))
        # surrogatepass: a lone surrogate in a message comes back as it went
        replies.write(_frame(tag + text.encode("utf-8", "surrogatepass")))
        replies.flush()


def _handle(request: dict[str, Any]) -> tuple[bytes, str]:
    budget = TemplateBudget(**request["budget"])
    memory_error = (
        f"chat template: rendering exceeded the memory limit of "
        f"{budget.max_memory_bytes / (1 << 20):g} MiB"
    )
    restore = _limit_resources(budget)
    try:
        text = _render(
            request["template"],
            request["messages"],
            request["add_generation_prompt"],
            request["variables"],
            budget.max_output_chars,
        )
    except TemplateLimitError as e:
        return _LIMIT, str(e)
    except TokenizerError as e:
        if isinstance(e.__cause__, MemoryError):
            return _LIMIT, memory_error
        return _ERROR, str(e)
    except MemoryError:
        return _LIMIT, memory_error
    finally:
        restore()
    return _TEXT, text


def _limit_resources(budget: TemplateBudget) -> Callable[[], None]:
    """Cap this process's address space at its current size plus the budget, and its CPU time
    (a backstop, should the parent die mid-render); returns the function that undoes it."""
    with open("/proc/self/statm") as f:
        address_space = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    limits = {
        resource.RLIMIT_AS: address_space + budget.max_memory_bytes,
        resource.RLIMIT_CPU: int(usage.ru_utime + usage.ru_stime + budget.seconds) + 2,
    }
    saved = {which: resource.getrlimit(which) for which in limits}
    for which, soft in limits.items():
        hard = saved[which][1]
        resource.setrlimit(
            which, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard)
        )

    def restore() -> None:
        for which, saved_limits in saved.items():
            resource.setrlimit(which, saved_limits)

    return restore


# -- the parent process --


class _WorkerDied(Exception):
    pass


class _Worker:
    """One worker process, used by one thread at a time."""

    def __init__(self) -> None:
        started = time.perf_counter()
        argv = [json.dumps(sys.path), str(Path(__file__).parent)]
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOTSTRAP, *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        except OSError as e:  # out of processes or descriptors
            raise TokenizerError(f"chat template: cannot start a rendering worker: {e}") from e
        try:
            ready = self._receive(time.monotonic() + _START_TIMEOUT_S, 1024)
        except _WorkerDied:
            ready = None
        if ready != (_READY, ""):
            self.kill()
            raise TokenizerError("chat template: the rendering worker did not start")
        logger.info(
            "chat template worker %d started in %.0f ms",
            self.proc.pid,
            (time.perf_counter() - started) * 1e3,
        )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):  # unwritten bytes for a dead reader
                    stream.close()

    def render(self, request: dict[str, Any], budget: TemplateBudget) -> str:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(_frame(pickle.dumps(request, pickle.HIGHEST_PROTOCOL)))
            self.proc.stdin.flush()
            reply = self._receive(
                time.monotonic() + budget.seconds, 4 * budget.max_output_chars + (1 << 16)
            )
        except (_WorkerDied, OSError) as e:
            self.kill()
            logger.warning("chat template worker %d failed: %s", self.proc.pid, e)
            # most likely a C allocation that failed under RLIMIT_AS and aborted the process
            raise TemplateLimitError(
                f"chat template: the rendering worker died ({e}), likely past the memory limit "
                f"of {budget.max_memory_bytes / (1 << 20):g} MiB"
            ) from e
        if reply is None:
            self.kill()
            logger.warning(
                "chat template worker %d killed past %s s", self.proc.pid, budget.seconds
            )
            raise TemplateLimitError(
                f"chat template: rendering exceeded the time limit of {budget.seconds} s"
            )
        tag, text = reply
        if tag == _TEXT:
            return text
        if tag == _LIMIT:
            self.kill()  # it may be short of memory now, or hold a huge cache: start a clean one
            raise TemplateLimitError(text)
        raise TokenizerError(text)

    def _receive(self, deadline: float, max_bytes: int) -> tuple[bytes, str] | None:
        """The worker's next message, or None if it is not complete by ``deadline``."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        readable = select.poll()  # not select(): a server's descriptors go past FD_SETSIZE
        readable.register(fd, select.POLLIN)
        data = bytearray()
        need = _HEADER.size
        while len(data) < need:
            timeout_ms = (deadline - time.monotonic()) * 1e3
            if timeout_ms <= 0 or not readable.poll(timeout_ms):
                return None
            chunk = os.read(fd, min(need - len(data), 1 << 20))
            if not chunk:
                raise _WorkerDied(f"exit status {self.proc.wait()}")
            data += chunk
            if need == _HEADER.size == len(data):
                (size,) = _HEADER.unpack(data)
                if size > max_bytes:
                    raise _WorkerDied(f"a reply of {size} bytes, over {max_bytes}")
                need += size
        tag = bytes(data[_HEADER.size : _HEADER.size + 1])
        return tag, data[_HEADER.size + 1 :].decode("utf-8", "surrogatepass")


class WorkerPool:
    """Up to ``size`` workers, started on demand and shared by any number of threads; a thread
    that finds them all busy waits for one."""

    def __init__(self, size: int = POOL_SIZE) -> None:
        self.size = size
        self._idle: list[_Worker] = []
        self._workers: set[_Worker] = set()  # idle or busy, for close()
        self._starting = 0
        self._cond = threading.Condition()

    def render(self, request: dict[str, Any], budget: TemplateBudget) -> str:
        worker = self._acquire()
        try:
            return worker.render(request, budget)
        finally:
            with self._cond:
                if worker.alive:
                    self._idle.append(worker)
                else:
                    self._workers.discard(worker)
                self._cond.notify()

    def _acquire(self) -> _Worker:
        with self._cond:
            while True:
                while self._idle:
                    idle = self._idle.pop()
                    if idle.alive:
                        return idle
                    self._workers.discard(idle)
                if len(self._workers) + self._starting < self.size:
                    break
                self._cond.wait()
            self._starting += 1
        worker: _Worker | None = None
        try:
            worker = _Worker()
            return worker
        finally:
            with self._cond:
                self._starting -= 1
                if worker is not None:
                    self._workers.add(worker)
                self._cond.notify()

    def close(self) -> None:
        """Kill every worker (a thread rendering on one gets an error)."""
        with self._cond:
            workers, self._workers, self._idle = self._workers, set(), []
        for worker in workers:
            worker.kill()


_POOL = WorkerPool()
atexit.register(_POOL.close)


def render_in_worker(
    template: str,
    messages: list[Any],
    add_generation_prompt: bool,
    variables: dict[str, Any],
    budget: TemplateBudget,
    pool: WorkerPool = _POOL,
) -> str:
    """``chat._render`` in a worker process under ``budget``; inputs are JSON types already."""
    request = {
        "template": template,
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "variables": variables,
        "budget": dataclasses.asdict(budget),
    }
    return pool.render(request, budget)
