"""The continuous-batching engine: ``add_request`` / ``step`` (Inferflow's AddQuery / Infer).

A request added between steps joins the very next step. One step = schedule (token budget) ->
execute one flat batch of every scheduled token (selective batching: token-wise ops see one
(N, hidden) tensor; attention runs per request against its paged KV blocks) -> update (sample,
stop checks, free finished requests).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from inferflow.engine.batch_sampling import take_rows
from inferflow.engine.beam import BeamState, BeamSteps
from inferflow.engine.constrain import mask_rows
from inferflow.engine.forward import Rows, forward_rows
from inferflow.engine.kv_cache import PagedKVCache, SeqBlocks, plan_cache
from inferflow.engine.request import FINISHED, Request, RequestOutput, Scheduled, TokenLogprobs
from inferflow.engine.sampling import SamplingParams, make_sampler, sample_batch
from inferflow.engine.scheduler import Scheduler, SchedulerConfig
from inferflow.engine.speculative import SpecConfig, SpecStats, Speculator
from inferflow.errors import RequestError, SpecError, context_exceeded
from inferflow.model.network import Network, PagedDecoder

log = logging.getLogger(__name__)

# KV blocks mapped ahead of use while the engine is idle (Engine.warm_cache): 64 MiB holds the
# keys and values of ~1,450 SmolLM2-135M tokens in float32 (45 KiB a token), most of a burst of
# 32 64-token prompts (benchmarks/prefill_burst.py --warm). A slice a call (~1 ms of page
# faults) is all a request arriving meanwhile waits.
WARM_AHEAD, WARM_SLICE = 64 << 20, 2 << 20


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = SchedulerConfig()
    block_size: int = 16
    kv_cache_bytes: int = 256 << 20  # memory for K and V of all requests together
    # batch-invariant by construction: every request runs its own forward pass, prompts are
    # prefilled in chunks at fixed positions, later tokens one at a time, no prefix sharing
    deterministic: bool = False
    # speculative decoding (inferflow.engine.speculative); None: off
    speculative: SpecConfig | None = None
    # how K/V are kept (kv_cache.KVFormat: float32, float16, bfloat16, q8); None: the model's dtype
    kv_cache_dtype: str | None = None


class Engine(BeamSteps):
    def __init__(
        self,
        model: Network,
        tokenizer: object | None = None,
        config: EngineConfig | None = None,
        draft: Network | None = None,  # the draft model of speculative method "draft"
    ) -> None:
        kind = model.spec.network.type
        # every decoder_only network, whole or partitioned, is a PagedDecoder
        if kind != "decoder_only" or not isinstance(model, PagedDecoder):
            raise SpecError(
                f"spec {model.spec.name!r}: the continuous-batching engine (and inferflow serve) "
                f"runs decoder_only networks, not {kind}; use `inferflow translate` / "
                "`inferflow embed` or inferflow.engine.search / inferflow.engine.embed"
            )
        self.model: PagedDecoder = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        h = model.spec.hparams
        dtype = next(model.parameters()).dtype
        # a partitioned model's rank 0 keeps K/V for its own layers and KV heads only
        geometry = model.kv_geometry()
        cfg = self.config
        plan = plan_cache(
            geometry, cfg.block_size, cfg.kv_cache_bytes, dtype, h.max_positions, cfg.kv_cache_dtype
        )
        self.cache = PagedKVCache(
            *geometry, cfg.block_size, plan.num_blocks, dtype, cfg.kv_cache_dtype
        )
        sched = self.config.scheduler
        if self.config.deterministic and sched.prefix_caching:
            sched = dataclasses.replace(sched, prefix_caching=False)
        self.scheduler = Scheduler(sched, self.cache, fixed_chunks=self.config.deterministic)
        self.requests: dict[str, list[Request]] = {}  # request id -> its n samples
        self.eos_ids = set(
            getattr(tokenizer, "eos_ids", None) or ([h.eos_id] if h.eos_id is not None else [])
        )
        self.max_len = plan.max_len
        self._ids = itertools.count()
        self._aborted: list[Request] = []
        self.beams: dict[str, BeamState] = {}  # request id -> its beam search
        spec = self.config.speculative
        self.spec = None
        if spec is not None:
            self.spec = Speculator(spec, model, draft, plan.num_blocks, self.config.block_size)

    @property
    def spec_stats(self) -> SpecStats:
        """Speculative decoding's counts so far (zeros without it)."""
        return self.spec.stats if self.spec is not None else SpecStats()

    # --- API --------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt)  # type: ignore[attr-defined]
        else:
            ids = [int(t) for t in prompt]
        self.check(ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        arrival = next(self._ids)
        # sample 0 computes the prompt; the others fork its KV blocks when it first samples
        # (a beam search forks its beams as it goes)
        n = 1 if params.beam_width > 1 else params.n
        group = [self._new_request(rid, i, ids, params, arrival) for i in range(n)]
        group[0].forks = group[1:]
        if params.beam_width > 1:
            self.beams[rid] = BeamState(params.beam_width, params.length_penalty)
        self.scheduler.add(group[0])
        self.requests[rid] = group
        return rid

    def check(self, ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if the request cannot run; reads only the engine's configuration,
        so another thread may call it (the server validates before queueing)."""
        # (not model.batch.check_input: a prompt here leaves a position for the first new
        # token, and the KV cache may hold less than the model's context)
        if not ids:
            raise RequestError("the prompt is empty: give at least one token", "prompt")
        h = self.model.spec.hparams
        vocab = h.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}", "prompt"
            )
        if len(ids) >= self.max_len:  # (the first new token needs a position of its own)
            where = "" if self.max_len == h.max_positions else " here (what the KV cache holds)"
            raise context_exceeded(self.max_len, len(ids), where=where)
        for name, toks in (
            ("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)
        ):  # fmt: skip
            bad = sorted(t for t in toks if not 0 <= t < vocab)
            if bad:  # (sampling would fail mid-decode)
                raise RequestError(
                    f"{name}: token id {bad[0]} is outside the vocabulary 0..{vocab - 1}"
                )
        if params.beam_width > 1:
            # every beam must fit at once, each with blocks of its own (a preempted beam is
            # recomputed alone while its siblings wait for it, holding theirs)
            bs, total = self.cache.block_size, self.cache.alloc.num_blocks
            longest = min(len(ids) + params.max_new_tokens, self.max_len)
            need = params.beam_width * -(-longest // bs)
            if need > total:
                raise RequestError(
                    f"beam_width: {params.beam_width} beams of up to {longest} tokens need "
                    f"{need} KV-cache blocks; the cache has {total} (lower beam_width or "
                    "max_tokens, or give the KV cache more memory)"
                )
        most = self.scheduler.cfg.max_running
        if params.n > most or params.beam_width > most:
            what = (
                f"beam_width: {params.beam_width} beams"
                if params.beam_width > 1
                else f"n: {params.n} samples"
            )
            raise RequestError(f"{what} exceed max_running ({most})")

    def _new_request(
        self, rid: str, i: int, ids: list[int], params: SamplingParams, arrival: int
    ) -> Request:
        if i and params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + i)
        detok = (
            self.tokenizer.incremental_decoder(  # type: ignore[attr-defined]
                params.skip_special_tokens, params.spaces_between_special_tokens
            )
            if self.tokenizer is not None
            else None
        )
        sampler = make_sampler(params, tuple(self.eos_ids))
        return Request(
            rid if i == 0 else f"{rid}/{i}",
            ids,
            params,
            arrival,
            sampler,
            detok=detok,
            group=rid,
            index=i,
            constraint=None if params.grammar is None else params.grammar.start(),
            kv=SeqBlocks(salt=params.cache_salt),
        )

    def abort(self, request_id: str) -> bool:
        live = [r for r in self.requests.get(request_id, []) if r.status != FINISHED]
        self.beams.pop(request_id, None)
        for req in live:
            self.scheduler.remove(req)
            self._finish(req, "abort")
            self._aborted.append(req)
        return bool(live)

    def warm_cache(self) -> bool:
        """For idle time: map the pages of the next ``WARM_AHEAD`` bytes of never-used KV blocks
        (``WARM_SLICE`` a call), so that a burst's prompts write their keys and values to mapped
        memory. False when they are mapped already."""
        return self.cache.warm_ahead(WARM_AHEAD, WARM_SLICE)

    def has_unfinished(self) -> bool:
        """True while a step has work: requests to run, or abort events not yet returned."""
        return bool(self.scheduler.running or self.scheduler.waiting or self._aborted)

    def step(self) -> list[RequestOutput]:
        outputs = [
            RequestOutput(r.group, [], "", True, "abort", index=r.index) for r in self._aborted
        ]
        self._aborted.clear()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.max_len)
        batch = self.scheduler.schedule()
        if batch:
            batch, logits, failed = self._execute(batch)
            outputs += failed
            if batch:
                outputs += self._update(batch, logits)
        for out in outputs:  # a request whose samples all ended has had its last event
            group = self.requests.get(out.request_id, [])
            if out.finished and all(r.status == FINISHED for r in group):
                self.requests.pop(out.request_id, None)
        return outputs

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | None = None
    ) -> list[Request]:
        """Blocking: run until every prompt finishes; returns the finished requests in order
        (the n samples of a prompt next to each other)."""
        groups = [self.requests[self.add_request(p, params)] for p in prompts]
        while any(r.status != FINISHED for g in groups for r in g):
            self.step()
        return [r for g in groups for r in g]  # (a beam search leaves its n best here)

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        rid = self.add_request(prompt, params)
        left = self.requests[rid][0].params.n
        while left:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    left -= out.finished

    # --- execute and update -------------------------------------------------------------------

    @torch.inference_mode()
    def _execute(
        self, batch: list[Scheduled]
    ) -> tuple[list[Scheduled], torch.Tensor, list[RequestOutput]]:
        """The batch's logits (one row per sampled sequence). If the batched forward pass
        fails, each request runs alone: those that fail alone end with finish reason "error",
        the others go on (a rerun rewrites the same K/V at the same positions). Returns the
        sequences that ran, their logits and the failed requests' final outputs."""
        if not self.config.deterministic:
            try:
                return batch, self._forward(batch), []
            except Exception:
                log.warning(
                    "a step of %d sequences failed; running each alone", len(batch), exc_info=True
                )
        ran: list[tuple[Scheduled, torch.Tensor]] = []
        failed: list[RequestOutput] = []
        for s in batch:  # (deterministic: the same shapes whatever else runs)
            if s.req.status == FINISHED:  # (a sibling's failure ended its group)
                continue
            try:
                ran.append((s, self._forward([s])))
            except Exception:
                log.exception("request %s failed in the forward pass; the others go on", s.req.id)
                failed += self.fail_group(s.req.group)
        ran = [(s, x) for s, x in ran if s.req.status != FINISHED]
        rows = [x for _, x in ran]
        logits = torch.cat(rows) if rows else torch.empty(0)
        return [s for s, _ in ran], logits, failed

    def _forward(self, batch: list[Scheduled]) -> torch.Tensor:
        items = []
        for s in batch:
            req = s.req
            toks = req.tokens if req.draft is None else req.tokens + req.draft.tokens
            # a generated token fed back is a decode row; a prompt's rows never are, however
            # they are chunked (inferflow.model.stack: the same path for a token in any batch)
            rows = s.length if req.draft is not None else int(s.sample)
            items.append(
                Rows(
                    req.kv,
                    s.start,
                    toks[s.start : s.start + s.length],
                    s.start >= len(req.prompt_ids),
                    rows,
                )
            )
        logits = forward_rows(self.model, self.cache, items)
        for s in batch:
            s.req.kv.num_computed = s.start + s.length
            if self.scheduler.cfg.prefix_caching and s.req.draft is None:
                self.cache.register_full_blocks(s.req.kv, s.req.tokens)
        return logits

    def _update(self, batch: list[Scheduled], logits: torch.Tensor) -> list[RequestOutput]:
        draws: list[tuple[Request, int]] = []  # (request, its row of logits)
        checks: list[tuple[Request, torch.Tensor]] = []  # (request, its rows for its drafts)
        beams: dict[str, None] = {}
        row = 0  # the request's first row of logits
        for req in [s.req for s in batch if s.sample]:
            i = row
            if req.draft is not None:  # its token fed back and its drafts: a row each
                row += 1 + len(req.draft.tokens)
                checks.append((req, logits[i:row]))
                continue
            row += 1
            if req.group in self.beams:
                req.pending = logits[i]
                beams[req.group] = None
                continue
            forks, req.forks = req.forks, []
            for f in forks:  # the prompt is computed: the other samples share its blocks
                f.kv = self.cache.fork(req.kv)
                self.scheduler.join(f)
            draws += [(r, i) for r in (req, *forks)]
        outputs = self._sample_all(draws, logits)
        outputs += [self._check(req, rows) for req, rows in checks]
        for gid in beams:
            try:
                outputs += self._beam_step(gid)
            except Exception:  # one search's failure ends only that search
                log.exception("beam search %s failed; the others go on", gid)
                outputs += self.fail_group(gid)
        return outputs

    def _check(self, req: Request, rows: torch.Tensor) -> RequestOutput:
        """Verify the request's drafts against the target's ``rows`` (after its token fed back
        and after each draft), append what they give and emit it as one output."""
        assert self.spec is not None
        draft = req.draft
        try:
            toks, n = self.spec.check(req, rows)
        except Exception:
            log.exception("request %s: checking its drafts failed; the others go on", req.id)
            return self._fail(req)
        # K/V are right through the accepted drafts; the rest is rewritten by later steps
        req.kv.num_computed = len(req.tokens) + n
        if self.scheduler.cfg.prefix_caching:
            self.cache.register_full_blocks(req.kv, req.tokens + draft.tokens[:n])
        outs = []
        for j, tok in enumerate(toks):
            outs.append(self._sample(req, rows[j], tok))
            if outs[-1].finished:
                break
        out = outs[0]
        for o in outs[1:]:
            out.token_ids += o.token_ids
            out.text += o.text
            out.finished, out.finish_reason = o.finished, o.finish_reason
            if out.logprobs is not None and o.logprobs is not None:
                out.logprobs += o.logprobs
        return out

    def _sample_all(
        self, draws: list[tuple[Request, int]], logits: torch.Tensor
    ) -> list[RequestOutput]:
        """Every sampling request's next token in one vectorized call; if that call fails, each
        request alone, so that a bad request ends only itself."""
        if not draws:
            return []
        reqs, rows = [r for r, _ in draws], [i for _, i in draws]
        x = take_rows(logits, rows)  # (forks share their parent's row)
        # structured output: what each grammar forbids next is -inf (in place: x is either a
        # copy or, when every row is a draw, the logits themselves, read by nothing else; an
        # inference tensor, written inside inference mode)
        with torch.inference_mode():
            broken = self._mask(x, reqs)
        try:
            toks: list[int | None] = list(
                sample_batch(
                    [r.sampler for r in reqs],
                    x,
                    [r.prompt_ids for r in reqs],
                    [r.output_ids for r in reqs],
                )
            )
        except Exception:
            log.warning("batched sampling failed; sampling each request alone", exc_info=True)
            toks = [None] * len(draws)
        return [
            self._fail(r, broken[j]) if j in broken else self._sample(r, x[j], t)
            for j, (r, t) in enumerate(zip(reqs, toks, strict=True))
        ]

    def _mask(self, x: torch.Tensor, reqs: list[Request]) -> dict[int, str | None]:
        """Mask the constrained rows of ``x`` in one call; if that fails, row by row, and the
        rows whose mask failed are returned with what the client is told (those requests end
        with "error", no one else)."""
        bound = [j for j, r in enumerate(reqs) if r.constraint is not None]
        if not bound:
            return {}
        try:
            mask_rows(x, bound, [reqs[j].constraint for j in bound])
            return {}
        except Exception:
            log.info("batched grammar masks failed; masking each request alone")
        broken: dict[int, str | None] = {}
        for j in bound:
            try:
                mask_rows(x, [j], [reqs[j].constraint])
            except RequestError as e:  # (the request's own grammar: said to its client)
                log.info("request %s: %s", reqs[j].id, e)
                broken[j] = str(e)
            except Exception:
                log.exception("request %s: its grammar mask failed", reqs[j].id)
                broken[j] = None
        return broken

    def _sample(self, req: Request, row: torch.Tensor, tok: int | None = None) -> RequestOutput:
        """Append ``tok`` (drawn now by the request's sampler when None) and emit it."""
        try:
            if tok is None:
                tok = req.sampler(row, req.prompt_ids, req.output_ids)
            req.output_ids.append(tok)
            if req.constraint is not None:
                req.constraint.consume(tok)
            out = self._emit(req, tok)
            if req.params.logprobs is not None:
                out.logprobs = [token_logprobs(row, tok, req.params.logprobs)]
            return out
        except RequestError as e:  # (the request's own doing, e.g. its grammar: said to it)
            log.info("request %s failed: %s", req.id, e)
            return self._fail(req, str(e))
        except Exception:  # one request's failure (sampler, detokenizer) ends only that request
            log.exception("request %s failed; the others go on", req.id)
            return self._fail(req)

    def _fail(self, req: Request, error: str | None = None) -> RequestOutput:
        """End one sample with finish reason "error"; ``error``: what its client is told when
        the request itself is at fault."""
        self.scheduler.remove(req)
        self._finish(req, "error")
        return RequestOutput(req.group, [], "", True, "error", index=req.index, error=error)

    def fail_group(self, gid: str) -> list[RequestOutput]:
        """End every live sample (or beam) of request ``gid`` with finish reason "error"."""
        self.beams.pop(gid, None)
        outs = []
        for req in self.requests.pop(gid, []):
            if req.status != FINISHED:
                outs.append(self._fail(req))
        return outs

    def fail_all(self) -> list[RequestOutput]:
        """End every request with finish reason "error" (the last resort when a step fails
        outside any one request's work)."""
        return [out for gid in list(self.requests) for out in self.fail_group(gid)]

    def _emit(self, req: Request, tok: int) -> RequestOutput:
        p = req.params
        reason = None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            reason = "stop"
            if p.include_stop_str_in_output and req.detok is not None:
                req.text += req.detok.push(tok) + req.detok.flush()
        else:
            if req.detok is not None:
                req.text += req.detok.push(tok)
            if req.constraint is not None and req.constraint.stopped():
                reason = "stop"  # the grammar is complete: only an end token could follow
            elif len(req.output_ids) >= p.max_new_tokens or len(req.tokens) >= self.max_len:
                reason = "length"
            if reason is not None and req.detok is not None:
                req.text += req.detok.flush()
        text, hit = _visible_text(req, p.stop, reason is not None, p.include_stop_str_in_output)
        reason = "stop" if hit else reason
        first = req.prompt_ids if len(req.output_ids) == 1 else None
        if reason:
            self.scheduler.remove(req)
            self._finish(req, reason)
        return RequestOutput(
            req.group,
            [tok],
            text,
            reason is not None,
            reason,
            first,
            index=req.index,
            cached_tokens=req.cached_tokens if first is not None else 0,
        )

    def _finish(self, req: Request, reason: str) -> None:
        req.status = FINISHED
        req.finish_reason = reason
        if self.spec is not None:
            self.spec.forget(req)


def _visible_text(
    req: Request, stops: tuple[str, ...], final: bool, keep_stop: bool = False
) -> tuple[str, bool]:
    """New text to emit, and whether a stop string ended the request (``keep_stop``: the text
    ends with it, else just before it). Text that could still be the start of a stop string is
    held back until the next token settles it."""
    hold = max(map(len, stops), default=1) - 1  # a stop string's first chars may be pending
    hits = [
        (i, i + len(s) if keep_stop else i)
        for s in stops
        if (i := req.text.find(s, max(0, req.shown - hold))) >= 0
    ]
    if hits:
        req.text = req.text[: min(hits)[1]]
    end = len(req.text) if final or hits else max(req.shown, len(req.text) - hold)
    text, req.shown = req.text[req.shown : end], end
    return text, bool(hits)


# a token the request rules out (a grammar's mask) has log-probability -inf, which JSON cannot
# carry: reported as this floor, as vLLM reports it
LOGPROB_FLOOR = -9999.0


def token_logprobs(row: torch.Tensor, tok: int, n: int) -> TokenLogprobs:
    lp = torch.log_softmax(row.float(), dim=-1).clamp(min=LOGPROB_FLOOR)
    top = torch.topk(lp, n) if n else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else []
    return TokenLogprobs(tok, float(lp[tok]), pairs)
