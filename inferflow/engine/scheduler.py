"""Iteration-level scheduling on a token budget (Orca / vLLM): no separate prefill and decode
phases. Each step, running requests go first (oldest first, one decode token or their next
prefill chunk), then waiting ones are admitted while budget, running slots and KV blocks last.
Prefill positions (prompts, recomputed tokens) take at most ``max_prefill_tokens`` of a step's
budget, so a burst of prompts finishes a few at a time while every running sequence still gets
its next token each step. When the KV cache runs out, the newest running request is preempted:
its blocks are freed and it is recomputed later from its tokens.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from inferflow.engine.kv_cache import KVCacheFull, PagedKVCache
from inferflow.engine.request import RUNNING, WAITING, Request, Scheduled
from inferflow.errors import RequestError

log = logging.getLogger(__name__)


class QueueFull(RequestError):
    """The waiting queue is at its bound: the caller should retry later (HTTP 429)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_batched_tokens: int = 512
    max_running: int = 64
    max_waiting: int = 1024
    prefix_caching: bool = True
    # prefill positions a step takes at most (within max_batched_tokens; deterministic mode's
    # chunks take the whole budget). Smaller steps finish a burst's first prompts sooner, but
    # each step also runs every decode row: benchmarks/prefill_burst.py, 32 prompts of 64
    # tokens, mean time to the first token against 512: 0.90x at 256 and 192, 0.92x at 128
    # (SmolLM2), 0.92x at 256 (Qwen2.5-0.5B); the same tokens a second, long prompts alike
    max_prefill_tokens: int = 256

    def __post_init__(self) -> None:
        for k in ("max_batched_tokens", "max_running", "max_waiting", "max_prefill_tokens"):
            if getattr(self, k) < 1:
                raise RequestError(f"{k}: must be >= 1, got {getattr(self, k)}")


class Scheduler:
    def __init__(
        self, cfg: SchedulerConfig, cache: PagedKVCache, fixed_chunks: bool = False
    ) -> None:
        self.cfg, self.cache = cfg, cache
        # deterministic mode: a request's forward shapes never depend on the others (prompt
        # chunks start at multiples of max_batched_tokens, later tokens go one at a time)
        self.fixed_chunks = fixed_chunks
        self.waiting: deque[Request] = deque()
        self.queued = 0  # requests in ``waiting`` that never ran (preempted ones come back too)
        self.running: list[Request] = []
        self.preemptions = 0

    def add(self, req: Request) -> None:
        """Queue a new request. ``max_waiting`` bounds the new requests not yet started; one
        preempted back into ``waiting`` was admitted already and does not count."""
        if self.queued >= self.cfg.max_waiting:
            raise QueueFull(
                f"the waiting queue is full ({self.cfg.max_waiting} requests); retry later"
            )
        self.waiting.append(req)
        self.queued += 1

    def join(self, req: Request) -> None:
        """A fork (a sample or beam sharing a running request's blocks) runs from now on."""
        req.status, req.started = RUNNING, True
        self.running.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            if not req.started:
                self.queued -= 1
        self.cache.release(req.kv)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.cache.release(victim.kv)
        victim.draft = None  # (recomputed from its tokens: its drafts' rows are gone)
        victim.status = WAITING
        self.waiting.appendleft(victim)
        self.preemptions += 1
        log.info("preempted request %s (KV cache full); it will be recomputed", victim.id)

    def schedule(self) -> list[Scheduled]:
        budget = self.cfg.max_batched_tokens
        fill = budget if self.fixed_chunks else min(self.cfg.max_prefill_tokens, budget)
        out: list[Scheduled] = []
        for req in sorted(self.running, key=lambda r: r.arrival):
            if budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            filling = self._filling(req)
            take = self._take(req, min(budget, fill) if filling else budget)
            if take and req.draft is not None:
                take = self._with_draft(req, take, budget)
            if not take or not self._reserve_running(req, req.kv.num_computed + take, out):
                continue
            fill -= take if filling else 0
            out.append(
                Scheduled(
                    req, req.kv.num_computed, take, req.kv.num_computed + take >= len(req.tokens)
                )
            )
            budget -= take
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if len(self.running) + req.slots > self.cfg.max_running:
                break  # (n samples or W beams need as many running slots)
            if self.cfg.prefix_caching and req.kv.num_computed == 0 and not req.kv.blocks:
                hit = self.cache.match_prefix(req.kv, req.tokens)
                if not req.started:  # (what the client's prompt found cached, once)
                    req.cached_tokens = min(hit, len(req.prompt_ids))
            filling = self._filling(req)
            take = self._take(req, min(budget, fill) if filling else budget)
            if not take:
                break
            try:
                self.cache.reserve(req.kv, req.kv.num_computed + take)
            except KVCacheFull:
                self.cache.release(req.kv)  # drop shared prefix blocks; retried next step
                break
            self.waiting.popleft()
            if not req.started:
                self.queued -= 1
            req.status, req.started = RUNNING, True
            self.running.append(req)
            fill -= take if filling else 0
            out.append(
                Scheduled(
                    req, req.kv.num_computed, take, req.kv.num_computed + take == len(req.tokens)
                )
            )
            budget -= take
        return out

    @staticmethod
    def _filling(req: Request) -> bool:
        """Whether ``req``'s next positions are a prefill (more than the one token a decode
        step computes): they count against ``max_prefill_tokens``."""
        return len(req.tokens) - req.kv.num_computed > 1

    def _take(self, req: Request, budget: int) -> int:
        """Tokens of ``req`` to compute this step (0: it waits for a step with more budget)."""
        done, todo = req.kv.num_computed, len(req.tokens) - req.kv.num_computed
        if not self.fixed_chunks:
            return min(todo, budget)
        chunk = self.cfg.max_batched_tokens
        n_prompt = len(req.prompt_ids)
        want = min(chunk - done % chunk, n_prompt - done) if done < n_prompt else 1
        return want if want <= budget else 0

    def _with_draft(self, req: Request, take: int, budget: int) -> int:
        """A decode step that also checks the request's drafted tokens where the budget and
        free blocks allow (no one is preempted for them); otherwise its drafts are dropped."""
        draft = req.draft
        draft.truncate(budget - take)
        if draft.tokens:
            try:
                self.cache.reserve(req.kv, req.kv.num_computed + take + len(draft.tokens))
                return take + len(draft.tokens)
            except KVCacheFull:
                pass
        req.draft = None
        return take

    def _reserve_running(self, req: Request, upto: int, scheduled: list[Scheduled]) -> bool:
        """Blocks for ``req`` up to ``upto``, preempting the newest others; False if ``req`` itself
        had to go."""
        taken = {s.req.id for s in scheduled}
        while True:
            try:
                self.cache.reserve(req.kv, upto)
                return True
            except KVCacheFull:
                candidates = [r for r in self.running if r.id not in taken]
                victim = max(candidates, key=lambda r: r.arrival)
                self._preempt(victim)
                if victim is req:
                    return False
