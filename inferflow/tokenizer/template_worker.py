"""Chat templates rendered under a ``TemplateBudget``, and structured-output grammars validated
under ``GrammarLimits``, in worker processes that can be killed.

A Python thread cannot be interrupted, and a grammar compiler that recurses too deep takes its
process down, so such work runs in one of a few long-lived worker processes: the worker caps its
own address space (``RLIMIT_AS``) for each call, so a runaway string ends in a ``MemoryError``,
and the parent kills it (SIGKILL) past the time limit (or finds it dead) and starts a fresh one
on the next call. Over the worker's stdin and stdout go length-prefixed
frames: a pickled request, and a tagged UTF-8 reply (the parent never unpickles what a worker
sends).

Workers are plain subprocesses, not multiprocessing's spawn (which re-imports the parent's
``__main__``, the CLI with torch): the bootstrap imports this module without running
``inferflow/tokenizer/__init__.py`` or ``inferflow/engine/__init__.py``, so a worker loads only
jinja2 and the template environment, ``jinja_env`` (and llguidance with ``grammar_bounds`` for its first grammar).
Grammars go to a pool of their own (``GRAMMAR_POOL``), so a slow one never delays a template,
and its workers run at a lower priority than the engine.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferflow.engine.grammar_bounds import GrammarLimits, check_bounds, validated_text
from inferflow.errors import RequestError, TokenizerError
from inferflow.tokenizer.jinja_env import TemplateBudget, TemplateLimitError, render_here

logger = logging.getLogger(__name__)

POOL_SIZE = 2
_START_TIMEOUT_S = 30.0
_HEADER = struct.Struct("!Q")  # byte length of the frame that follows
# reply tags: ready, rendered text, error, limit error
_READY, _TEXT, _ERROR, _LIMIT = b"R", b"T", b"E", b"L"

GRAMMAR_STACK_BYTES = 16 << 20  # a grammar's validation thread in the worker (the server's
# own compile threads have 16x that: what passes here cannot overflow there)
GRAMMAR_MEMORY_BYTES = 1 << 30
GRAMMAR_NICE = 10

# Run by the worker's interpreter (argv: sys.path as JSON, the directories of inferflow.tokenizer
# and inferflow.engine). Bare modules registered as those packages let their submodules import
# without running their __init__ (the tokenizer package's imports the tokenizers library).
_BOOTSTRAP = """\
import json, sys, types
sys.path[:0] = json.loads(sys.argv[1])
for name, path in (("inferflow.tokenizer", sys.argv[2]), ("inferflow.engine", sys.argv[3])):
    package = types.ModuleType(name)
    package.__path__ = [path]
    sys.modules[name] = package
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
    if "grammar" in request:
        return _validate_grammar(request)
    budget = TemplateBudget(**request["budget"])
    memory_error = (
        f"chat template: rendering exceeded the memory limit of "
        f"{budget.max_memory_bytes / (1 << 20):g} MiB"
    )
    restore = _limit_resources(budget.seconds, budget.max_memory_bytes)
    try:
        text = render_here(
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


def _validate_grammar(request: dict[str, Any]) -> tuple[bytes, str]:
    """``validated_text`` for a grammar request, in a thread with a stack of
    GRAMMAR_STACK_BYTES (a deeper recursion ends this process: the parent answers for it)."""
    if os.getpriority(os.PRIO_PROCESS, 0) < GRAMMAR_NICE:
        os.setpriority(os.PRIO_PROCESS, 0, GRAMMAR_NICE)
    limits = GrammarLimits(**request["limits"])
    reply: list[tuple[bytes, str]] = []

    def run() -> None:
        try:
            reply.append((_TEXT, validated_text(request["kind"], request["grammar"], limits)))
        except RequestError as e:
            reply.append((_ERROR, str(e)))
        except MemoryError:
            reply.append((_LIMIT, f"validating took more than {GRAMMAR_MEMORY_BYTES >> 20} MiB"))

    restore = _limit_resources(limits.seconds, GRAMMAR_MEMORY_BYTES)
    threading.stack_size(GRAMMAR_STACK_BYTES)
    try:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    finally:
        restore()
    return reply[0] if reply else (_LIMIT, "the grammar compiler failed")


def _limit_resources(seconds: float, max_memory_bytes: int) -> Callable[[], None]:
    """Cap this process's address space at its current size plus ``max_memory_bytes``, and its
    CPU time (a backstop, should the parent die mid-call); returns the function that undoes
    it."""
    with open("/proc/self/statm") as f:
        address_space = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    limits = {
        resource.RLIMIT_AS: address_space + max_memory_bytes,
        resource.RLIMIT_CPU: int(usage.ru_utime + usage.ru_stime + seconds) + 2,
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


@dataclass(frozen=True)
class _Errors:
    """What a kind of work raises: ``limit`` past a limit (``died`` and ``slow`` format the
    worker's death and the time limit into its message), ``error`` for its own failure."""

    what: str
    limit: Callable[[str], Exception]
    error: Callable[[str], Exception]
    died: str
    slow: str


class _Worker:
    """One worker process, used by one thread at a time."""

    def __init__(self) -> None:
        started = time.perf_counter()
        here = Path(__file__).parent
        argv = [json.dumps(sys.path), str(here), str(here.parent / "engine")]
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

    def call(self, request: dict[str, Any], seconds: float, max_reply: int, errors: _Errors) -> str:
        """The worker's text for ``request`` within ``seconds``; ``errors`` names the work in
        what is raised when it fails or the worker dies or runs out of time."""
        assert self.proc.stdin is not None
        try:
            frame = _frame(pickle.dumps(request, pickle.HIGHEST_PROTOCOL))
        except RecursionError:
            raise errors.error(f"{errors.what}: the input nests too deeply to send") from None
        try:
            self.proc.stdin.write(frame)
            self.proc.stdin.flush()
            reply = self._receive(time.monotonic() + seconds, max_reply)
        except (_WorkerDied, OSError) as e:
            self.kill()
            logger.warning("%s worker %d failed: %s", errors.what, self.proc.pid, e)
            raise errors.limit(errors.died.format(e)) from e
        if reply is None:
            self.kill()
            logger.warning("%s worker %d killed past %s s", errors.what, self.proc.pid, seconds)
            raise errors.limit(errors.slow.format(seconds))
        tag, text = reply
        if tag == _TEXT:
            return text
        if tag == _LIMIT:
            self.kill()  # it may be short of memory now, or hold a huge cache: start a clean one
            raise errors.limit(text)
        raise errors.error(text)

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

    def call(self, request: dict[str, Any], seconds: float, max_reply: int, errors: _Errors) -> str:
        worker = self._acquire()
        try:
            return worker.call(request, seconds, max_reply, errors)
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
GRAMMAR_POOL = WorkerPool()
atexit.register(_POOL.close)
atexit.register(GRAMMAR_POOL.close)


def render_in_worker(
    template: str,
    messages: list[Any],
    add_generation_prompt: bool,
    variables: dict[str, Any],
    budget: TemplateBudget,
    pool: WorkerPool = _POOL,
) -> str:
    """``jinja_env.render_here`` in a worker process under ``budget``; inputs are JSON types already."""
    request = {
        "template": template,
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "variables": variables,
        "budget": dataclasses.asdict(budget),
    }
    errors = _Errors(
        "chat template",
        TemplateLimitError,
        TokenizerError,
        # most likely a C allocation that failed under RLIMIT_AS and aborted the process
        "chat template: the rendering worker died ({}), likely past the memory limit of "
        f"{budget.max_memory_bytes / (1 << 20):g} MiB",
        "chat template: rendering exceeded the time limit of {} s",
    )
    return pool.call(request, budget.seconds, 4 * budget.max_output_chars + (1 << 16), errors)


def validate_in_worker(
    kind: str, value: Any, limits: GrammarLimits, pool: WorkerPool = GRAMMAR_POOL
) -> str:
    """``grammar_bounds.validated_text`` in a worker process: the constraint's grammar text,
    or a RequestError naming the bound it broke, llguidance's complaint, the time limit, or
    the worker's death (a recursion too deep for GRAMMAR_STACK_BYTES)."""
    check_bounds(kind, value, limits)  # (the cheap refusals need no worker)
    request = {"kind": kind, "grammar": value, "limits": dataclasses.asdict(limits)}
    errors = _Errors(
        "grammar",
        RequestError,
        RequestError,
        f"{kind}: compiling it ended the compiler ({{}}): it nests or chains too deeply",
        f"{kind}: compiling it took longer than the limit of {{}} s ({limits.flag('seconds')})",
    )
    return pool.call(request, limits.seconds, 2 * limits.max_bytes + (16 << 20), errors)
