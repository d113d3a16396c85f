"""Batched model calls that are not engine requests: embeddings (encoder-only and declared
decoder networks) and encoder-decoder search (completions of a seq2seq model).

Handlers ``submit`` a job (its inputs and the call that serves a group of them) and await its
future. The model thread runs ``run_pending`` between engine steps (or alone, for networks the
engine does not run): every job waiting then whose key is equal runs in one call over all their
inputs, so concurrent requests share forward passes. The queue is bounded in inputs (the
server's ``--max-waiting``): past it ``submit`` raises QueueFull (HTTP 429). A job ``abandon``ed
before it ran (its client went away) leaves the queue, and the bound, at once; a job whose
future was cancelled is dropped unrun. A job ``abandon``ed while it runs keeps its place, and
once every job of its group is abandoned the call's ``stop`` check answers True, so a long call
(a search) can end early (``Stopped``).

A call that a client can make long (scoring a prompt: ``echo``, ``prompt_logprobs``) is a
generator: it yields after each chunk of its work and returns its results. Such a call is
resumed one chunk per ``run_pending``, one resumable call at a time in turn, so the engine steps
between its chunks (every stream keeps its pace), and it ends within one chunk once every job
it serves is abandoned.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from inferflow.engine.scheduler import QueueFull
from inferflow.errors import Stopped

log = logging.getLogger(__name__)

# one call over a group's inputs, returning one result per input, in order (or a generator that
# yields between chunks of its work and returns them); the second argument answers True once
# nobody waits for the results any more (a call may check it and stop early)
Steps = Generator[None, None, Sequence[Any]]
GroupCall = Callable[[list[list[int]], Callable[[], bool]], Sequence[Any] | Steps]


@dataclass
class Job:
    key: Hashable  # jobs with equal keys run in one call
    inputs: list[list[int]]
    call: GroupCall
    future: Future[list[Any]]


class Batcher:
    def __init__(self, max_waiting: int, wake: Callable[[], None] = lambda: None) -> None:
        self.max_waiting, self.wake = max_waiting, wake
        self.jobs: list[Job] = []
        self.lock = threading.Lock()
        self.waiting = 0  # inputs in the queue
        self.abandoned: set[Future[list[Any]]] = set()  # running jobs nobody waits for
        self.running: list[Job] = []  # the jobs run_pending took and has not finished
        self.resumable: list[tuple[list[Job], Steps]] = []  # generator calls, in turn

    def submit(self, key: Hashable, inputs: list[list[int]], call: GroupCall) -> Future[list[Any]]:
        """Queue ``inputs`` (validated by the caller); the future gets one result per input."""
        fut: Future[list[Any]] = Future()
        with self.lock:
            if self.waiting and self.waiting + len(inputs) > self.max_waiting:
                raise QueueFull(
                    f"the waiting queue is full ({self.waiting} of {self.max_waiting} inputs "
                    "queued); retry later"
                )  # (one request larger than the bound still runs when the queue is empty)
            self.jobs.append(Job(key, inputs, call, fut))
            self.waiting += len(inputs)
        self.wake()
        return fut

    def pending(self) -> bool:
        return bool(self.jobs or self.resumable)

    def abandon(self, future: Future[list[Any]]) -> None:
        """Nobody waits for ``future``'s job any more (its client went away): dropped if it has
        not started (its inputs leave the bound at once, not at the next ``run_pending``), and
        counted towards stopping its group's call if it is running."""
        with self.lock:
            for i, job in enumerate(self.jobs):
                if job.future is future:
                    del self.jobs[i]
                    self.waiting -= len(job.inputs)
                    break
            if not future.cancel() and not future.done():
                self.abandoned.add(future)

    def abandon_all(self) -> None:
        """``abandon`` every job, queued or running (the server is shutting down)."""
        with self.lock:
            resumed = [job for group, _ in self.resumable for job in group]
            futures = [job.future for job in (*self.jobs, *self.running, *resumed)]
        for future in futures:
            self.abandon(future)

    def run_pending(self) -> None:
        """On the model thread: run every queued job, one call per key, and one chunk of the
        resumable call whose turn it is."""
        if self.resumable:
            group, steps = self.resumable.pop(0)
            # (alone: a call that fails midway settles its group with the error, no retry)
            if self._settle(group, lambda: self._advance(group, steps), alone=True):
                self.resumable.append((group, steps))  # not finished: back in the line
        if not self.jobs:
            return
        with self.lock:
            jobs, self.jobs, self.waiting = self.jobs, [], 0
            self.running = jobs
        groups: dict[Hashable, list[Job]] = {}
        for job in jobs:
            if job.future.set_running_or_notify_cancel():  # False: cancelled, drop it
                groups.setdefault(job.key, []).append(job)
        try:
            for group in groups.values():
                self._run_group(group)
        finally:
            with self.lock:
                self.running = []

    def _run_group(self, group: list[Job]) -> None:
        """One call over the group's inputs; if it fails, each job alone, so that a failure
        stays with the job that caused it."""
        if not self._call(group):
            log.warning("a batched call over %d jobs failed; running each alone", len(group))
            for job in group:
                if not job.future.done():
                    self._call([job])

    def _stopper(self, group: list[Job]) -> Callable[[], bool]:
        def stop() -> bool:
            with self.lock:
                return all(job.future in self.abandoned for job in group)

        return stop

    def _call(self, group: list[Job]) -> bool:
        """Run one call over ``group``'s inputs and settle their futures (a generator call is
        started and kept for ``run_pending`` to resume); False (nothing settled) when it failed
        and the group has several jobs to retry alone."""
        inputs = [ids for job in group for ids in job.inputs]

        def start() -> Sequence[Any] | None:
            result = group[0].call(inputs, self._stopper(group))
            if isinstance(result, Generator):
                self.resumable.append((group, result))
                return None
            return result

        return self._settle(group, start, len(group) == 1) is not False

    def _advance(self, group: list[Job], steps: Steps) -> Sequence[Any] | None:
        """One chunk of a resumable call: its results once it returns, else None."""
        if self._stopper(group)():
            steps.close()
            raise Stopped("every client of this call went away")
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        return None

    def _settle(
        self, group: list[Job], work: Callable[[], Sequence[Any] | None], alone: bool
    ) -> bool | None:
        """Run ``work`` for ``group`` and settle their futures with its results or its error.
        Returns True when it is not finished (it returned None), False when it failed and the
        group has several jobs to retry alone (nothing settled), None once settled."""
        inputs = sum(len(job.inputs) for job in group)
        outcome: list[Any] | Exception
        try:
            result = work()
            if result is None:
                return True
            outcome = list(result)
            if len(outcome) != inputs:
                raise RuntimeError(f"{len(outcome)} results for {inputs} inputs")
        except Stopped as e:  # every client of the group went away
            log.info("a batched call over %d inputs stopped: %s", inputs, e)
            outcome = e
        except Exception as e:  # the group's requests fail; the server goes on
            if not alone:
                return False
            log.exception("a batched call over %d inputs failed", inputs)
            outcome = e
        at = 0
        with self.lock:
            for job in group:
                if isinstance(outcome, Exception):
                    job.future.set_exception(outcome)
                else:
                    job.future.set_result(outcome[at : at + len(job.inputs)])
                at += len(job.inputs)
                self.abandoned.discard(job.future)
        return None
