"""The engine in its own thread, fed by HTTP handlers on the event loop.

Handlers never touch the engine: they post ``add`` / ``abort`` messages to an inbox the engine
thread drains before every step, and read outputs from a per-request asyncio queue. An abort
posted between two steps therefore frees the request's KV blocks before the next one. Model
calls that are not engine requests (embeddings, encoder-decoder search) go through the
runner's ``Batcher``, which the same thread runs between steps. A network the engine does not
run (encoder-only, encoder-decoder) gets a runner without an engine: the thread then serves the
batcher alone.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from inferflow.engine.engine import Engine
from inferflow.engine.request import RequestOutput
from inferflow.engine.sampling import SamplingParams
from inferflow.engine.scheduler import QueueFull
from inferflow.errors import InferflowError, RequestError
from inferflow.server.batcher import Batcher, GroupCall
from inferflow.server.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class Stream:
    """What a handler holds for one request: its outputs arrive on ``queue``."""

    id: str
    n: int  # samples not yet finished
    queue: asyncio.Queue[RequestOutput]
    created: float = field(default_factory=time.monotonic)
    last: dict[int, float] = field(default_factory=dict)  # per sample: time of its last token


class ClientGone(Exception):
    """The client disconnected before its response was ready: nothing is sent, one line is
    logged (at INFO)."""


class ModelFailed(Exception):
    """The model failed on a request (an engine step, a batched call): HTTP 500 with type
    "server_error". The cause is logged on the model thread; the client gets no internals."""


class EngineRunner:
    def __init__(self, engine: Engine | None, metrics: Metrics, max_waiting: int) -> None:
        self.engine, self.metrics = engine, metrics
        self.inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.streams: dict[str, Stream] = {}
        self.wake = threading.Event()
        self.batcher = Batcher(max_waiting, self.wake.set)
        self.stopping = False
        self.warming = True  # (until Engine.warm_cache fails once)
        # requests posted to the inbox and taken from it (each written by one thread only)
        self.posted = self.taken = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, name="inferflow-engine", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread.start()

    def stop(self) -> None:
        """Abort what is still in flight (its streams get finish reason "abort"), then stop."""
        self.inbox.put(("abort_all",))
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=30)

    # --- called from the event loop --------------------------------------------------------

    def submit(
        self, prompts: list[list[int]], params: SamplingParams, out: asyncio.Queue[RequestOutput]
    ) -> list[Stream]:
        """Queue one request per prompt, all or none: each is validated and the waiting queue
        must hold them all (else QueueFull, nothing queued). Their outputs go to ``out``."""
        assert self.engine is not None, "generation requests need an engine"
        for ids in prompts:
            self.engine.check(ids, params)
        bound = self.engine.scheduler.cfg.max_waiting
        if len(prompts) > bound:
            raise RequestError(
                f"prompt: {len(prompts)} prompts exceed the waiting queue's bound "
                f"(--max-waiting {bound}); send at most {bound} per request"
            )
        waiting = self.engine.scheduler.queued + self.posted - self.taken
        if waiting + len(prompts) > bound:
            raise QueueFull(
                f"the waiting queue is full ({waiting} of {bound} requests waiting, "
                f"{len(prompts)} more asked); retry later"
            )
        streams = [Stream(f"req-{uuid.uuid4().hex}", params.n, out) for _ in prompts]
        for stream, ids in zip(streams, prompts, strict=True):
            self.streams[stream.id] = stream
            self.posted += 1
            self._post("add", stream.id, ids, params)
        return streams

    def abort(self, rid: str) -> None:
        self._post("abort", rid)

    def abort_all(self) -> None:
        """End everything in flight: engine requests with finish reason "abort", batched calls
        (embeddings, searches) stopped at their next check."""
        self._post("abort_all")
        self.batcher.abandon_all()

    async def batch(self, key: Hashable, inputs: list[list[int]], call: GroupCall) -> list[Any]:
        """``call``'s results for ``inputs``, batched with other jobs of the same ``key``
        (``Batcher``); QueueFull when its queue is at the bound. Cancelled (the client went
        away), the job is dropped if it has not started, and a running call over it may stop
        once every job it serves is gone (``Batcher.abandon``). A call that fails with an
        InferflowError passes it on (a bad request: 400); any other failure becomes
        ModelFailed (500), as a failed engine step does."""
        future = self.batcher.submit(key, inputs, call)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.batcher.abandon(future)
            raise
        except InferflowError:
            raise
        except Exception as e:  # (logged with its traceback where the call ran: Batcher)
            raise ModelFailed(
                f"the model failed on this request ({type(e).__name__}); the server log has "
                "the details"
            ) from e

    def _post(self, *msg: Any) -> None:
        self.inbox.put(msg)
        self.wake.set()

    # --- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._drain()
            if self.batcher.pending():  # (run_pending takes the lock: not on every step)
                self.batcher.run_pending()
            engine = self.engine
            if engine is not None:
                self.metrics.engine_state(engine)
            if engine is None or not engine.has_unfinished():  # nothing to step
                if self.stopping:
                    return
                if self.batcher.pending():
                    continue
                if engine is not None and not self.wake.is_set() and self._warm(engine):
                    continue  # (a slice at a time: a request waits ~1 ms at most)
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            try:
                outs = engine.step()
            except Exception:  # a failed forward pass: its requests end with "error"
                log.exception("engine step failed; ending the requests in flight")
                outs = engine.fail_all()
            self._deliver(outs)  # (the gauges update after the next drain)

    def _warm(self, engine: Engine) -> bool:
        """One slice of ``Engine.warm_cache`` (idle time only). It only maps memory ahead: a
        failure is logged and ends the warming, never this thread."""
        if not self.warming:
            return False
        try:
            return engine.warm_cache()
        except Exception:
            log.exception("mapping the KV cache ahead of use failed; serving goes on without it")
            self.warming = False
            return False

    def _drain(self) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            kind = msg[0]
            if kind == "add":
                assert self.engine is not None
                _, rid, ids, params = msg
                try:
                    self.engine.add_request(ids, params, request_id=rid)
                    self.metrics.prompt_tokens.inc(len(ids))
                except Exception as e:  # (submit checked it: a bug, not the client's doing)
                    log.exception("request %s could not be queued: %s", rid, e)
                    self._deliver(
                        [
                            RequestOutput(rid, [], "", True, "error", index=i)
                            for i in range(params.n)
                        ]
                    )
                finally:  # (after the add: submit's count never sees the request in neither)
                    self.taken += 1
            elif kind == "abort" and self.engine is not None:
                self.engine.abort(msg[1])
            elif kind == "abort_all" and self.engine is not None:
                for rid in list(self.engine.requests):
                    self.engine.abort(rid)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        now = time.monotonic()
        done = []
        puts: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]] = []
        for o in outs:
            s = self.streams.get(o.request_id)
            if s is None:
                continue
            if o.cached_tokens and o.index == 0:
                self.metrics.cached_tokens.inc(o.cached_tokens)
            if o.token_ids:
                self.metrics.generation_tokens.inc(len(o.token_ids))
                prev = s.last.get(o.index)
                if prev is None:
                    self.metrics.ttft.observe(now - s.created)
                else:
                    self.metrics.itl.observe(now - prev)
                s.last[o.index] = now
            if o.finished:
                self.metrics.finished.labels(o.finish_reason or "unknown").inc()
                s.n -= 1
                if s.n == 0:
                    self.metrics.e2e.observe(now - s.created)
                    done.append(s.id)
            puts.append((s.queue, o))
        if puts:  # one wake-up of the event loop a step, not one per stream (a syscall each)
            assert self.loop is not None
            self.loop.call_soon_threadsafe(_put_all, puts)
        for rid in done:
            self.streams.pop(rid, None)


def _put_all(puts: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]) -> None:
    for q, out in puts:
        q.put_nowait(out)


async def until_disconnect(work: Awaitable[Any], gone: Callable[[], Awaitable[bool]]) -> Any:
    """``work``'s result; if ``gone()`` turns true first (the client disconnected), ``work`` is
    cancelled (whatever it holds is released in its own cleanup: engine requests aborted,
    a batched job not yet taken dropped) and ClientGone is raised."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not await gone():
            await asyncio.sleep(0.1)

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        raise ClientGone("the client disconnected")
    return task.result()
