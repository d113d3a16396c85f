"""Structured-output constraints compiled for the server, where a bad one can hurt no one else.

A constraint goes through three gates, each bounded: its size and shape (``GrammarLimits``,
checked before any compiler sees it), llguidance's compile and validation in a worker process
that a crash or the time limit ends (``validate_in_worker``), and then the matcher built in
this process from the validated text (``compile_text``, which also tries its first steps). The
last runs on threads of the compiler's own, with stacks 16 times the worker's, so a grammar
that passed the worker cannot overflow here, and compiles never wait behind tokenizing or
templates (asyncio's default pool).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from inferflow.engine.constrain import Grammar, compile_text
from inferflow.engine.grammar_bounds import GrammarLimits
from inferflow.engine.scheduler import QueueFull
from inferflow.tokenizer.template_worker import GRAMMAR_STACK_BYTES, validate_in_worker

THREADS = 2
STACK_BYTES = 16 * GRAMMAR_STACK_BYTES
MAX_QUEUED = 32  # compiles waiting for a thread; past it a request gets 429


class GrammarCompiler:
    """``compile`` constraints on THREADS threads of STACK_BYTES each, started on first use."""

    def __init__(self, limits: GrammarLimits) -> None:
        self.limits = limits
        self.jobs: queue.SimpleQueue[tuple[Callable[[], Grammar], Future[Grammar]]] = (
            queue.SimpleQueue()
        )
        self.queued = 0
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    async def compile(self, kind: str, value: Any, ll: Callable[[], Any]) -> Grammar:
        """The constraint compiled for the tokenizer ``ll()`` builds (llguidance's view, built
        once per tokenizer, on these threads too); RequestError naming what is wrong with it,
        QueueFull when MAX_QUEUED compiles wait already."""

        def run() -> Grammar:
            text = validate_in_worker(kind, value, self.limits)
            return compile_text(kind, text, ll())

        future: Future[Grammar] = Future()
        with self.lock:
            if self.queued >= MAX_QUEUED:
                raise QueueFull(
                    f"{self.queued} structured-output grammars are waiting to compile; retry later"
                )
            self.queued += 1
            self._start()
        self.jobs.put((run, future))
        return await asyncio.wrap_future(future)

    def _start(self) -> None:
        """Start the threads (under the lock): the stack size applies to threads started
        while it is set, so it is set only around their start."""
        if self.threads:
            return
        previous = threading.stack_size(STACK_BYTES)
        try:
            for i in range(THREADS):
                t = threading.Thread(target=self._serve, name=f"inferflow-grammar-{i}", daemon=True)
                t.start()
                self.threads.append(t)
        finally:
            threading.stack_size(previous)

    def _serve(self) -> None:
        while True:
            run, future = self.jobs.get()
            with self.lock:
                self.queued -= 1
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(run())
            except BaseException as e:  # (the handler raises it on the event loop)
                future.set_exception(e)
